"""lm-evaluation-harness against ``orca-lab serve --model gpt2``, offline: its ``local-completions``
model scores a loglikelihood task (echo + logprobs) and a generate_until task (stop strings) from
``tests/lm_eval_tasks/``, with GPT-2's tokenizer written locally in the Hugging Face layout
(``save_gpt2_hf``: nothing downloaded). Its numbers must equal the same tasks scored in process from
``LLM``'s own prompt logprobs and greedy completions."""
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from orca_lab import LLM, SamplingParams
from orca_lab.serving.launch import ServerProcess
from orca_lab.tokenizer import save_gpt2_hf

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def llm():
    llm = LLM("gpt2", seed=0)
    if llm.tokenizer is None:
        pytest.skip("GPT-2's BPE ranks are not installed (tiktoken + openai-whisper)")
    return llm


def lm_eval_run(url: str, tokenizer: Path, out: Path):
    exe = shutil.which("lm_eval") or shutil.which("lm-eval")
    if exe is None:
        pytest.skip("lm-eval is not installed (pip install lm-eval)")
    args = ",".join(["model=gpt2", f"base_url={url}/v1/completions", "tokenizer_backend=huggingface",
                     f"tokenizer={tokenizer}", "tokenized_requests=True", "max_length=1024", "max_retries=1"])
    r = subprocess.run([exe, "run", "--model", "local-completions", "--model_args", args,
                        "--tasks", "orca_lab_choice,orca_lab_gen", "--include_path", str(TASKS),
                        "--output_path", str(out), "--log_samples", "--seed", "0"],
                       cwd=ROOT, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    samples = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = sorted((json.loads(line) for line in f.read_text().splitlines()), key=lambda s: s["doc_id"])
    (results,) = out.rglob("results_*.json")
    return json.loads(results.read_text())["results"], samples


def docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / f"{name}.jsonl").read_text().splitlines()]


def score_choices(llm, doc) -> list[tuple[float, bool]]:
    """lm-eval's loglikelihood, in process: the continuation " choice" after the question, as it
    tokenizes them (whole string, context's tokens cut off), from the engine's prompt logprobs."""
    enc = llm.tokenizer.encode
    ctx = enc(doc["question"])
    wholes = [enc(doc["question"] + " " + c) for c in doc["choices"]]
    out = llm.complete(wholes, sampling_params=SamplingParams(max_gen_tokens=1, prompt_logprobs=1))
    scores = []
    for whole, c in zip(wholes, out):
        entries = c.prompt_logprobs[len(ctx):]
        assert [e.token for e in entries] == whole[len(ctx):]
        scores.append((sum(e.logprob for e in entries), all(e.top[0][0] == e.token for e in entries)))
    return scores


def test_lm_eval_scores_equal_the_engines_own(llm, tmp_path):
    tokenizer = save_gpt2_hf(tmp_path / "gpt2-tokenizer")
    with ServerProcess("--model", "gpt2", "--seed", "0", "--max-bs", "8", "--n-slots", "4096") as server:
        results, samples = lm_eval_run(server.url, tokenizer, tmp_path / "out")

    # loglikelihood: every choice's log-probability and greediness, then accuracy
    accs = []
    for doc, sample in zip(docs("choice"), samples["orca_lab_choice"]):
        want = score_choices(llm, doc)
        got = [(float(lp), flag == "True") for lp, flag in sample["filtered_resps"]]
        assert all(math.isclose(g[0], w[0], abs_tol=1e-3) and g[1] == w[1] for g, w in zip(got, want)), (got, want)
        accs.append(float(max(range(len(want)), key=lambda i: want[i][0]) == doc["answer"]))
        assert sample["acc"] == accs[-1]
    assert results["orca_lab_choice"]["acc,none"] == pytest.approx(sum(accs) / len(accs))

    # generate_until: greedy text up to the stop strings, then exact match
    params = SamplingParams(max_gen_tokens=8, ignore_eos=False, stop=("\n", EOS))
    gens = llm.complete([d["prompt"] for d in docs("gen")], sampling_params=params)
    for doc, sample, c in zip(docs("gen"), samples["orca_lab_gen"], gens):
        assert sample["filtered_resps"][0] == c.text
        assert sample["exact_match"] == float(c.text == doc["target"])
    want_em = sum(float(c.text == d["target"]) for c, d in zip(gens, docs("gen"))) / len(gens)
    assert results["orca_lab_gen"]["exact_match,none"] == pytest.approx(want_em)


def test_a_checkpoints_own_chat_template_serves_chat(tmp_path):
    """A checkpoint whose tokenizer_config.json carries a chat template: /v1/chat/completions renders
    it with no --chat-template (a GPT-2-vocabulary model of tiny width: its tokenizer is GPT-2's)."""
    import openai
    from orca_lab import ModelConfig
    from orca_lab.model.gpt import GPT
    from orca_lab.tokenizer import load_tokenizer

    if LLM("gpt2").tokenizer is None:
        pytest.skip("GPT-2's BPE ranks are not installed (tiktoken + openai-whisper)")
    path = tmp_path / "ckpt"
    GPT.random(ModelConfig("small", n_layers=2, d_model=32, n_heads=2, vocab_size=50257, max_seq_len=128),
               seed=3).save_pretrained(path)
    save_gpt2_hf(path)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert load_tokenizer(path).chat_template == template
    messages = [{"role": "user", "content": "Hello there"}]
    with ServerProcess("--model", path, "--n-slots", "512", env=OFFLINE) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        kw = dict(model=str(path), max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        chat = client.chat.completions.create(messages=messages, **kw)
        comp = client.completions.create(prompt="user: Hello there\nassistant:", **kw)
    assert chat.choices[0].message.content == comp.choices[0].text
    assert chat.usage.prompt_tokens == comp.usage.prompt_tokens
