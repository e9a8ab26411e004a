"""Run the real vLLM engine (dummy weights) with the lengthwise scheduler; print one JSON line.

Used by tests/test_engine_real.py in a subprocess (vLLM's engine owns process-wide state):
``python -m tests.engine_probe POLICY NUM_BLOCKS``. Each request asks for a different number of tokens
with ``ignore_eos``, so the exact output lengths prove nothing was lost, cut or duplicated.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: no spawn


def main() -> None:
    policy, blocks = sys.argv[1], int(sys.argv[2])
    from transformers import LlamaConfig

    model_dir = tempfile.mkdtemp(prefix="lengthwise-dummy-llama-")
    # head_dim 64: vLLM's CPU attention kernels reject smaller heads; block 32: the CPU backend's multiple
    LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=256, intermediate_size=512,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                bos_token_id=1, eos_token_id=2).save_pretrained(model_dir)
    os.environ["LENGTHWISE_SCHEDULER_CONFIG"] = json.dumps({"policy": policy, "default_pred_len": 24})
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              scheduler_cls="serving.engine.scheduler.LengthwiseScheduler", max_num_seqs=16, max_num_batched_tokens=128,
              enforce_eager=True, block_size=32, num_gpu_blocks_override=blocks, seed=0,
              gpu_memory_utilization=0.2)  # of host memory on CPU; the override sets the KV pool
    n = 16
    prompts = [TokensPrompt(prompt_token_ids=[3 + (7 * i + j) % 990 for j in range(16 + 3 * i)]) for i in range(n)]
    wants = [8 + 4 * i for i in range(n)]
    # every other request carries a prediction (under-predicted by half for some), the rest fall back
    params = [SamplingParams(max_tokens=w, ignore_eos=True, temperature=0.0,
                             extra_args={"pred_len": w // (2 if i % 4 == 0 else 1)} if i % 2 == 0 else None)
              for i, w in enumerate(wants)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    print(json.dumps({"scheduler": type(sched).__name__, "wants": wants,
                      "got": [len(o.outputs[0].token_ids) for o in outs],
                      "ids": [o.request_id for o in outs], "stats": sched.lengthwise_stats()}))


if __name__ == "__main__":
    main()
