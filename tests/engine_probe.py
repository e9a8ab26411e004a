"""Run the real vLLM engine with or without the lengthwise scheduler; print one JSON line.

Used by tests/test_engine_real.py in a subprocess (vLLM's engine owns process-wide state):

* ``python -m tests.engine_probe pressure POLICY NUM_BLOCKS``: a dummy-weight Llama, 16 requests each
  asking for a different number of tokens with ``ignore_eos``, so exact lengths prove nothing was lost,
  cut or duplicated under KV pressure.
* ``python -m tests.engine_probe sequential MODEL_DIR stock|POLICY``: a real model, chat prompts submitted
  one at a time at temperature 0; the token ids are printed for comparison between schedulers.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: no spawn
PLUGIN = "serving.engine.scheduler.LengthwiseScheduler"
COMMON = {"dtype": "float32", "enforce_eager": True, "block_size": 32, "seed": 0,
          "gpu_memory_utilization": 0.2}  # of host memory on the CPU backend


def pressure(policy: str, blocks: int) -> dict:
    from transformers import LlamaConfig

    model_dir = tempfile.mkdtemp(prefix="lengthwise-dummy-llama-")
    # head_dim 64: vLLM's CPU attention kernels reject smaller heads; block 32: the CPU backend's multiple
    LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=256, intermediate_size=512,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                bos_token_id=1, eos_token_id=2).save_pretrained(model_dir)
    port = os.environ.get("PROBE_METRICS_PORT")
    os.environ["LENGTHWISE_SCHEDULER_CONFIG"] = json.dumps({"policy": policy, "default_pred_len": 24,
                                                            **({"metrics_port": int(port)} if port else {})})
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, max_model_len=256, scheduler_cls=PLUGIN,
              max_num_seqs=16, max_num_batched_tokens=128, num_gpu_blocks_override=blocks, **COMMON)
    n = 16
    prompts = [TokensPrompt(prompt_token_ids=[3 + (7 * i + j) % 990 for j in range(16 + 3 * i)]) for i in range(n)]
    wants = [8 + 4 * i for i in range(n)]
    # every other request carries a prediction (under-predicted by half for some), the rest fall back
    params = [SamplingParams(max_tokens=w, ignore_eos=True, temperature=0.0,
                             extra_args={"pred_len": w // (2 if i % 4 == 0 else 1)} if i % 2 == 0 else None)
              for i, w in enumerate(wants)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    metrics = None
    if port:
        import urllib.request

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {"scheduler": type(sched).__name__, "wants": wants, "metrics": metrics,
            "got": [len(o.outputs[0].token_ids) for o in outs], "ids": [o.request_id for o in outs],
            "stats": sched.lengthwise_stats()}


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a KV cache is in one sentence."]


def sequential(model_dir: str, scheduler: str) -> dict:
    from vllm import LLM, SamplingParams

    kw = {}
    if scheduler != "stock":
        os.environ["LENGTHWISE_SCHEDULER_CONFIG"] = json.dumps({"policy": scheduler})
        kw["scheduler_cls"] = PLUGIN
    llm = LLM(model=model_dir, max_model_len=512, max_num_seqs=4, **COMMON, **kw)
    tokens = []
    for p in PROMPTS:
        out = llm.chat([{"role": "user", "content": p}], SamplingParams(max_tokens=24, temperature=0.0,
                                                                       extra_args={"pred_len": 24}), use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    return {"scheduler": type(sched).__name__, "tokens": tokens}


def main() -> None:
    mode, *args = sys.argv[1:]
    res = pressure(args[0], int(args[1])) if mode == "pressure" else sequential(args[0], args[1])
    print(json.dumps(res))


if __name__ == "__main__":
    main()
