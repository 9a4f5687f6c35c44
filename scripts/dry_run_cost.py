"""`python scripts/dry_run_cost.py`: what recording the boxes each loader reads adds to the vLLM dry run of a
manifest (every update's handshake), on the dense bench shape (Qwen2.5-0.5B, 290 tensors, TP 1)."""

import os
import tempfile

os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def measure(worker, wire, rounds):
    import time

    from groupbridge.vllm._compat import _dryrun
    from groupbridge.weights.manifest import Manifest

    m = Manifest.from_wire(wire)
    model = worker.model_runner.model
    out = {"with": [], "without": []}
    real = _dryrun._Reads

    class Off(real):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    boxes = {}
    for _ in range(rounds):
        for kind in ("with", "without"):
            _dryrun._Reads = real if kind == "with" else Off
            t0 = time.perf_counter()
            r = {}
            assert _dryrun.check_loadable(model, m, reads=r) is None
            out[kind].append(time.perf_counter() - t0)
            if kind == "with":
                boxes = r
    _dryrun._Reads = real
    out["partial"] = len(boxes)
    return out


if __name__ == "__main__":
    import statistics

    import vllm

    from groupbridge.vllm.models import make_model
    from groupbridge.weights.manifest import Manifest

    d = tempfile.mkdtemp()
    model = make_model(d, "qwen2", "bench", dtype="bfloat16")
    wire = Manifest.build(model.state_dict().items()).to_wire()
    llm = vllm.LLM(
        d,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_seqs=4,
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        weight_transfer_config={"backend": "groupbridge"},
    )
    res = llm.collective_rpc(measure, args=(wire, 7))[0]
    for k in ("with", "without"):
        v = res[k]
        median, worst = statistics.median(v) * 1000, max(v) * 1000
        print(f"dry run {k} box recording: median {median:.1f} ms, worst {worst:.1f} ms ({len(v)} rounds)")
    print("tensors read partially (TP 1):", res["partial"])
    from groupbridge.vllm._stop import shutdown

    shutdown(llm)
