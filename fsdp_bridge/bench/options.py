"""The bench's settings: the options given on the command line, each device's defaults for
those left unset, checked before any rank starts."""

from __future__ import annotations

DTYPES = ("fp32", "bf16")
# What an option left unset means on the CPU (--device cuda has its own, in bench/cuda.py).
CPU_DEFAULTS = dict(dtype="fp32,bf16", nproc=2, hidden=256, layers=4, vocab=1000, seq=128,
                    batch=4, heads=4, kv_heads=None, intermediate=None)


def _option(args, name: str, defaults: dict):
    value = getattr(args, name, None)
    return defaults[name] if value is None else value


def settings(args, defaults: dict = CPU_DEFAULTS) -> dict:
    """The run's settings: the options given, `defaults` for those left unset; checked."""
    given = {name: _option(args, name, defaults) for name in defaults}
    dtypes = [d.strip() for d in given["dtype"].split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"--dtype {given['dtype']!r}: expected a comma-separated list of {DTYPES}")
    if given["kv_heads"] is None:
        given["kv_heads"] = given["heads"]
    if given["intermediate"] is None:
        given["intermediate"] = 4 * given["hidden"]
    s = dict(steps=args.steps, warmup=args.warmup, repeats=args.repeats, dtypes=dtypes,
             **{k: v for k, v in given.items() if k != "dtype"})
    for name in ("steps", "repeats", "nproc", "hidden", "layers", "heads", "kv_heads",
                 "intermediate", "vocab", "seq", "batch"):
        if s[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} {s[name]}: must be at least 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: must be at least 0")
    if s["hidden"] % s["heads"] or (s["hidden"] // s["heads"]) % 2:
        raise ValueError(f"--hidden {s['hidden']}: must split into {s['heads']} attention heads "
                         "of an even size (for rotary embeddings); change --hidden or --heads")
    if s["heads"] % s["kv_heads"]:
        raise ValueError(f"--kv-heads {s['kv_heads']}: must divide --heads {s['heads']}")
    return s


# -- building each configuration (runs on every rank) -------------------------------------------
