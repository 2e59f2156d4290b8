#!/usr/bin/env python3
"""What a GPU peer does on this machine, in one short run.

    .venv/bin/python benchmarks/gpu_check.py [--model smollm2-135m-instruct] [--new 32] [--json OUT]

Three checks, each printed as it ends:

1. **The executor's CUDA path.** A ``tensor-map`` shard through
   ``ShardExecutor`` on ``cuda:0`` (the device a daemon's executor picks when
   torch sees one), against the same shard through an executor on the CPU:
   the device it ran on, its time, and whether the results agree.
2. **NVML power and clocks.** The power readout (now, the enforced limit and
   the range NVML allows), then the clock level the energy policy asks for:
   ``ShardExecutor.set_level(0.6)`` locks the graphics clock at 0.6 of its
   maximum (read back from NVML while a matmul loop runs), ``set_level(1.0)``
   resets it. Then the power limit: set to the lowest NVML allows, read back,
   restored. Setting either needs root; a refusal is printed, not raised.
3. **bf16 decode through 2 peers against transformers.** Two ``peer start``
   processes serve the model's two halves with ``--serve-device auto
   --serve-dtype bfloat16``; ``peer generate`` decodes ``--new`` tokens
   greedily through them. transformers' model from the same GGUF, in bf16 on
   the same device, decodes the same prompt greedily in this process, in two
   forms (``_hf_models``). It passes when the peers report the device and
   bf16 in ``/status`` and their tokens are those of the same bf16 spans run
   in this process. Printed beside it, for each transformers model: the
   greedy tokens' common prefix with the swarm's, at how many positions its
   argmax is the swarm's token when it reads the swarm's tokens, the largest
   logit gap where not, and its decode speed. bf16 rounds logits to 8 bits
   of mantissa, so two correct bf16 models part where two tokens nearly tie.

Without CUDA, checks 1 and 2 say why they were skipped and check 3 runs on
the CPU (still bf16, still two processes). Exit status 0 when every check
that ran passed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import trio

REPO = Path(__file__).resolve().parent.parent


def check_executor() -> dict[str, Any]:
    from fedswarm.runtime.executor import ShardExecutor
    from fedswarm.tasks.tensor_map import results_agree

    if not torch.cuda.is_available():
        return {"skipped": "torch sees no CUDA device"}
    params = {"seed": 7, "size": 2048, "iters": 16}
    out: dict[str, Any] = {"device_name": torch.cuda.get_device_name(0)}
    for dev in ("cuda:0", "cpu"):
        ex = ShardExecutor(slots=1, device=dev)
        res = trio.run(ex.run, "tensor-map", params, 0)
        out[dev] = {"device": res.device, "seconds": round(res.wall_seconds, 3), "result": res.result,
                    "energy_j": res.energy_joules}
    a, b = out["cuda:0"]["result"], out["cpu"]["result"]
    # the verifiers' test for results from different devices (a digest may differ by one rounding)
    out["results_agree"] = results_agree(a, b)
    out["digests_equal"] = a["digest"] == b["digest"]
    out["ok"] = out["cuda:0"]["device"].startswith("cuda") and out["results_agree"]
    for dev in ("cuda:0", "cpu"):
        out[dev].pop("result")
    return out


def _busy(stop: threading.Event) -> None:
    x = torch.randn(4096, 4096, device="cuda:0")
    while not stop.is_set():
        x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize()


def check_nvml() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "torch sees no CUDA device"}
    try:
        import pynvml
    except ImportError:
        return {"skipped": "pynvml is not installed (pip install nvidia-ml-py)"}
    from fedswarm.runtime.executor import ShardExecutor

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    clk = pynvml.NVML_CLOCK_GRAPHICS
    out: dict[str, Any] = {
        "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000,
        "limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
        "limit_range_w": [v / 1000 for v in pynvml.nvmlDeviceGetPowerManagementLimitConstraints(h)],
        "max_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, clk),
    }
    stop = threading.Event()
    busy = threading.Thread(target=_busy, args=(stop,), daemon=True)
    busy.start()
    try:
        time.sleep(1.0)  # the matmul loop reaches its clocks; NVML samples what it draws
        out["busy_clock_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, clk)
        out["busy_power_w"] = pynvml.nvmlDeviceGetPowerUsage(h) / 1000
        ex = ShardExecutor(slots=1, device="cuda:0")
        out["set_level_0.6"] = ex.set_level(0.6)
        time.sleep(1.0)
        out["level_0.6_clock_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, clk)
        out["level_0.6_power_w"] = pynvml.nvmlDeviceGetPowerUsage(h) / 1000
        out["set_level_1.0"] = ex.set_level(1.0)
        time.sleep(1.0)
        out["level_1.0_clock_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, clk)
        before = pynvml.nvmlDeviceGetPowerManagementLimit(h)
        lo = out["limit_range_w"][0]
        try:
            pynvml.nvmlDeviceSetPowerManagementLimit(h, int(lo * 1000))
            time.sleep(1.0)
            out["power_limit_set_w"] = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000
            out["power_at_limit_w"] = pynvml.nvmlDeviceGetPowerUsage(h) / 1000
        except pynvml.NVMLError as exc:
            out["power_limit_set_w"] = f"refused: {exc}"
        finally:
            try:
                pynvml.nvmlDeviceSetPowerManagementLimit(h, before)
            except pynvml.NVMLError:
                pass
            out["power_limit_restored_w"] = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000
    finally:
        stop.set()
        busy.join()
        pynvml.nvmlShutdown()
    top = out["max_clock_mhz"]
    out["ok"] = bool(out["set_level_0.6"]) and out["level_0.6_clock_mhz"] <= 0.6 * top + 15
    return out


def _hf_models(path: Path, device: str) -> dict[str, Any]:
    """transformers' two bf16 readings of the GGUF: ``gguf-bf16`` loads it with
    ``dtype=torch.bfloat16`` (transformers keeps the weights quantized and runs
    the matmuls in float32 between bf16 activations); ``bf16`` is its
    ``LlamaForCausalLM`` holding the dequantized weights in bf16, every op in
    bf16, the final norm and the LM head too."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
    from transformers.utils import logging as tlog

    from fedswarm.tasks.checkpoint import load_config, load_tensors
    from fedswarm.tasks.llama import block_keys, head_keys

    tlog.disable_progress_bar()
    ours = load_config(path)
    names = head_keys(ours) + [k for i in range(ours.num_hidden_layers) for k in block_keys(ours, i)]
    pure = LlamaForCausalLM(AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name))
    pure.load_state_dict(load_tensors(path, names), strict=not ours.tie_word_embeddings)
    packed = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16)
    return {"gguf-bf16": packed.to(device).eval(), "bf16": pure.to(device, torch.bfloat16).eval()}


def _hf_greedy(m: Any, prompt: list[int], n: int, device: str) -> tuple[list[int], float]:
    toks: list[int] = []
    with torch.no_grad():
        out = m(torch.tensor([prompt], device=device), use_cache=True)
        tok = int(out.logits[0, -1].argmax())
        toks.append(tok)
        t0 = time.perf_counter()
        while len(toks) < n:
            out = m(torch.tensor([[tok]], device=device), cache=out.cache, use_cache=True)
            tok = int(out.logits[0, -1].argmax())
            toks.append(tok)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    return toks, (n - 1) / secs


def _agreement(m: Any, prompt: list[int], got: list[int], device: str) -> dict[str, Any]:
    """``got`` read by ``m`` in one forward (teacher forcing): at how many
    positions ``m``'s argmax is ``got``'s token, and the largest logit gap
    between ``m``'s best token and ``got``'s where they differ."""
    with torch.no_grad():
        lg = m(torch.tensor([prompt + got[:-1]], device=device)).logits[0, len(prompt) - 1:].float()
    best = lg.argmax(-1).tolist()
    gaps = [float(lg[i].max() - lg[i, t]) for i, t in enumerate(got)]
    return {"argmax_agrees": sum(a == b for a, b in zip(best, got)), "of": len(got), "max_logit_gap": round(max(gaps), 4)}


def check_decode(model: str, n_new: int, work: Path) -> dict[str, Any]:
    from fedswarm.llm_client import common_prefix
    from fedswarm.tasks.checkpoint import load_block_span, load_client_head, load_config, resolve_model
    from fedswarm.tasks.llama import generate_greedy
    from fedswarm.testing.localswarm import LocalSwarm

    path = Path(resolve_model(model))
    layers = load_config(path).num_hidden_layers
    spans = [(0, layers // 2), (layers // 2, layers)]
    serve = [["--serve-model", model, "--blocks", f"{a}:{b}", "--serve-device", "auto", "--serve-dtype", "bfloat16"]
             for a, b in spans]
    out: dict[str, Any] = {}
    question = "Write a short story about a dragon who learns to bake bread."
    with LocalSwarm(2, work, per_peer_args=serve) as swarm:
        out["served"] = [{k: sp.get(k) for k in ("start", "end", "device", "dtype")}
                         for p in swarm.peers for sp in p.status()["spans"]]
        gen = work / "generate.json"
        r = subprocess.run([sys.executable, "-m", "fedswarm.cli", "generate", "--bootstrap", swarm.bootstrap,
                            "--model", model, "--chat", "--prompt", question, "--max-new-tokens", str(n_new),
                            "--greedy", "--out", str(gen)], capture_output=True, text=True)
        if r.returncode != 0:
            return {**out, "ok": False, "error": r.stderr.strip().splitlines()[-1:]}
        g = json.loads(gen.read_text())
    prompt, got = list(g["prompt_ids"]), list(g["token_ids"])
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    # the same bf16 spans in this process, on the same device, the head in float32 on the CPU as the client's
    one = generate_greedy(load_client_head(path), [load_block_span(path, a, b, device=device, dtype="bfloat16")
                                                   for a, b in spans], prompt, len(got))
    out.update({"tokens": len(got), "swarm_tok_s": g.get("tokens_per_s"), "swarm_text": g.get("text", ""),
                "one_process_same_tokens": one == got, "device": device})
    for name, m in _hf_models(path, device).items():
        ref, tps = _hf_greedy(m, prompt, len(got), device)
        out[f"transformers_{name}"] = {"common_prefix": common_prefix(got, ref), "tok_s": round(tps, 2),
                                       **_agreement(m, prompt, got, device)}
    out["ok"] = out["one_process_same_tokens"] and all(s["device"] == ("cuda:0" if device != "cpu" else "cpu")
                                                       and s["dtype"] == "bfloat16" for s in out["served"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model name, directory or .gguf")
    ap.add_argument("--new", type=int, default=32, help="tokens to decode in check 3")
    ap.add_argument("--json", help="write every figure here too")
    a = ap.parse_args()
    if a.new < 2:
        ap.error(f"--new {a.new}: decode at least 2 tokens")
    results: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    with tempfile.TemporaryDirectory(prefix="fedswarm-gpu-check-") as tmp:
        for name, fn in (("executor", check_executor), ("nvml", check_nvml),
                         ("decode", lambda: check_decode(a.model, a.new, Path(tmp)))):
            t0 = time.perf_counter()
            try:
                res = fn()
            except Exception as exc:  # a check that breaks is a result to print, and the others still run
                res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            res["check_s"] = round(time.perf_counter() - t0, 1)
            results[name] = res
            print(f"== {name}\n{json.dumps(res, indent=1, default=str)}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    return 0 if all(r.get("ok", True) for r in results.values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
