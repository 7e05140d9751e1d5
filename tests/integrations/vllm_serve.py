"""Serve saved highrank models with ``vllm.LLM`` and record what it generates.

Run by tests/integrations/test_vllm.py in vLLM's environment (where highrank's plugin is
installed): ``python vllm_serve.py JOB.json OUT.json``. JOB gives ``folders`` (name -> model
folder), ``prompts`` (token-id lists) and ``new_tokens``; OUT gets, per folder, each prompt's
greedy tokens and top-``LOGPROBS`` log-probabilities (token id -> log-prob) before each token,
or the error vLLM raised (JOB's ``trust_remote_code`` is passed on). All prompts of a model go
in one ``generate`` call (batched). By default vLLM runs its engine and its worker in
processes of their own, which load the plugin through its entry point, as ``vllm serve``
does (hence the ``__main__`` guard; about a minute per model on a loaded 2-core machine);
JOB's ``in_process`` keeps both in this process (a few seconds per model).
"""

from __future__ import annotations

import json
import os
import sys
import time

LOGPROBS = 20


def serve(folder: str, prompts: list[list[int]], new_tokens: int, **options) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=folder, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
        max_model_len=64, seed=0, **options,
    )  # fmt: skip
    params = SamplingParams(
        temperature=0.0, max_tokens=new_tokens, logprobs=LOGPROBS, ignore_eos=True,
        detokenize=False,
    )  # fmt: skip
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        results.append(
            {
                "tokens": list(completion.token_ids),
                "logprobs": [
                    {str(token): entry.logprob for token, entry in step.items()}
                    for step in completion.logprobs
                ],
            }
        )
    done = time.perf_counter()
    if hasattr(llm, "shutdown"):
        llm.shutdown()
    del llm
    return {"prompts": results, "start_s": started - start, "generate_s": done - started}


def main(job_path: str, out_path: str) -> None:
    job = json.loads(open(job_path).read())
    options = {"trust_remote_code": job.get("trust_remote_code", False)}
    if job.get("in_process"):  # engine and worker in this process: seconds, not a minute
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        options["distributed_executor_backend"] = "uni"
    out = {}
    for name, folder in job["folders"].items():
        try:
            out[name] = serve(folder, job["prompts"], job["new_tokens"], **options)
        except Exception as error:  # the test reads refusals from here
            out[name] = {"error": f"{type(error).__name__}: {error}"}
    with open(out_path, "w") as file:
        json.dump(out, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
