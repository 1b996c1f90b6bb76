"""An MLX checkpoint from the hub, served by the MLX back end."""

from __future__ import annotations

import openai


def test_serve_pulls_an_mlx_folder_and_the_mlx_back_end_answers(hf_env, mlx_repo,
                                                                start_server):
    server = start_server("--backend", "mlx", model=mlx_repo)
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
    reply = client.chat.completions.create(
        model=mlx_repo, messages=[{"role": "user", "content": "Name the capital of France."}],
        max_tokens=8, temperature=0)
    assert reply.model == mlx_repo and reply.choices[0].message.content
    assert server.models()[0]["butter"]["backend"] == "mlx"
