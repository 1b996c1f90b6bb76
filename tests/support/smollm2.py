"""What the conformance suite checks the shipped SmolLM2 checkpoint against."""

from butter.testing import ModelFacts

SMOLLM2 = ModelFacts(
    n_ctx_train=8192,
    eos_token="<|im_end|>",
    control_tokens={"<|im_start|>": 1, "<|im_end|>": 2},
    answer="Paris",  # the greedy answer to "Name the capital city of France."
)
