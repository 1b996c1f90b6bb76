"""The shipped GGUF's own chat template, rendered and tokenized."""

from reference import REFERENCE


def test_real_gguf_template_matches_the_reference(model_path):
    from butter.library import Model

    with Model.load(str(model_path)) as model:
        text = model.template.render([{"role": "user",
                                       "content": "What is the capital of France?"}])
        assert text == REFERENCE
        tokens = model.loaded.tokenize(text, add_special=False, parse_special=True)
    # <|im_start|> and <|im_end|> are single special tokens, not spelled out.
    assert tokens.count(1) == 3 and tokens.count(2) == 2
    assert tokens[:3] == [1, 9690, 198]
