"""Which of tern's CPU kernel builds a process uses, and how it is built and loaded.

The C sources (csrc/) are compiled once per instruction-set tier, with fixed compiler flags rather
than -march=native, so every tier is the same code on every machine and each can be compiled (and
tested, where the CPU runs it) anywhere:

    baseline     x86-64 (SSE2): the scalar loops only
    avx2         x86-64-v3: AVX2 + FMA (AMD EPYC Rome/Milan, Intel Haswell on)
    avx512       x86-64-v4: AVX-512 F/BW/CD/DQ/VL (Skylake-X, Ice Lake)
    avx512_bf16  + AVX512-BF16 (AMD Zen 4, Cooper Lake)
    amx          + AMX-TILE/AMX-BF16 (Sapphire Rapids on)

One probe of the CPU (`cpu_features()`, the flags in /proc/cpuinfo) picks the highest tier the
CPU runs. TERN_KERNELS overrides it for the whole process and its workers: `off` (pure-torch paths
everywhere), `auto` (the default), or a tier name (refused when the CPU lacks it). On other
architectures only `baseline` exists, compiled without -march.

Each build lands in TERN_HOME/kernels under a hash of the sources, flags and compiler, so a later
start-up only loads it. The exported functions' ctypes signatures are read from tern_kernels.h's
export block (one contract: a prototype changed there is a signature changed here), and the
sizes of the structs the fused decode layer passes are checked against the library's at load.
When no compiler is available or the build fails, the library is None (logged once) and callers
use their pure-torch paths: the kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from enginecore.config import tern_home

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
HEADER = SOURCE_DIR / "tern_kernels.h"
ABI_VERSION = 16
ENV_VAR = "TERN_KERNELS"
_COMMON_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11")

_vp, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


@dataclasses.dataclass(frozen=True)
class Tier:
    name: str
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags the CPU needs to run this build


def _x86_tiers() -> tuple[Tier, ...]:
    v3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    return (
        Tier("baseline", ("-march=x86-64",), frozenset()),
        Tier("avx2", ("-march=x86-64-v3",), v3),
        Tier("avx512", ("-march=x86-64-v4",), v4),
        # Every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and 5) has AVX512-VNNI.
        Tier(
            "avx512_bf16",
            ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
            v4 | {"avx512_bf16", "avx512_vnni"},
        ),
        Tier(
            "amx",
            ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"),
            v4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"},
        ),
    )


def all_tiers() -> tuple[Tier, ...]:
    """Every tier of this architecture, lowest first."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return _x86_tiers()
    return (Tier("baseline", (), frozenset()),)


def tier(name: str) -> Tier:
    for t in all_tiers():
        if t.name == name:
            return t
    raise ValueError(f"unknown kernel tier {name!r}: one of {[t.name for t in all_tiers()]}")


def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo; None where there is none (not Linux)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.partition(":")[2].strip()
    return None


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags (Linux's names, as in /proc/cpuinfo); empty where unknown."""
    return frozenset((_cpuinfo("flags") or "").split())


@functools.cache
def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC ..."), else the platform's processor or machine."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def runnable_tiers(features: frozenset[str] | None = None) -> tuple[Tier, ...]:
    """The tiers this CPU can run, lowest first."""
    features = cpu_features() if features is None else features
    return tuple(t for t in all_tiers() if t.cpu_flags <= features)


def choose_tier(setting: str | None, features: frozenset[str] | None = None) -> Tier | None:
    """The tier for TERN_KERNELS = `setting` on a CPU with `features`: None for "off"."""
    setting = (setting or "auto").strip().lower()
    if setting == "off":
        return None
    runnable = runnable_tiers(features)
    if setting == "auto":
        return runnable[-1]
    wanted = tier(setting)
    if wanted not in runnable:
        raise ValueError(
            f"{ENV_VAR}={setting}: this CPU cannot run that tier (it runs "
            f"{', '.join(t.name for t in runnable)}; missing "
            f"{', '.join(sorted(wanted.cpu_flags - (cpu_features() if features is None else features)))})"
        )
    return wanted


# --------------------------------------------------------------------------- the contract


class TernLinear(ctypes.Structure):
    pass


TernLinear._fields_ = [
    ("weight", _vp), ("scale", _vp), ("bias", _vp), ("n", _i32), ("k", _i32),
    ("weight_format", _i32), ("rest", ctypes.POINTER(TernLinear)), ("lora_a", _vp),
    ("lora_b", _vp), ("lora_seg_rows", _vp), ("lora_rank", _i32), ("lora_nseg", _i32),
    ("lora_num_slots", _i32), ("packed", _vp),
]  # fmt: skip


class TernDecodeLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", TernLinear), ("o", TernLinear), ("gate_up", TernLinear), ("down", TernLinear),
        ("input_norm", _vp), ("post_norm", _vp), ("attn_out_norm", _vp), ("mlp_out_norm", _vp),
        ("q_norm", _vp), ("k_norm", _vp), ("qk_norm_full", _i32), ("eps", _f32),
        ("attn_scale", _f32), ("attn_softcap", _f32), ("rotary_dim", _i32),
        ("rotary_interleaved", _i32), ("gelu", _i32), ("residual_scale", _f32), ("output_gate", _i32),
        ("hidden", _i32), ("num_heads", _i32), ("num_kv_heads", _i32), ("head_dim", _i32),
        ("intermediate", _i32), ("cos_cache", _vp), ("sin_cache", _vp), ("num_positions", _i64),
        ("k_cache", _vp), ("v_cache", _vp), ("num_slots", _i64), ("block_size", _i32),
        ("window", _i32), ("kv_format", _i32), ("sinks", _vp), ("shm", _vp), ("tp_rank", _i32), ("tp_size", _i32), ("shm_slot_bytes", _i64),
        ("shm_timeout_s", ctypes.c_double),
    ]  # fmt: skip


class TernDecodeStep(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _i32), ("positions", _vp), ("slots", _vp), ("block_tables", _vp),
        ("context_lens", _vp), ("table_stride", _i64), ("normed", _vp), ("qkv", _vp), ("q", _vp),
        ("attn", _vp), ("attn_out", _vp), ("gate_up", _vp), ("act", _vp), ("lora_slots", _vp),
    ]  # fmt: skip


STRUCTS = (TernLinear, TernDecodeLayer, TernDecodeStep)  # tern_struct_sizes()' order

_SCALARS = {
    "void": None,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
_DECLARATION = re.compile(r"^(?P<ret>[\w\s]+?\**)\s*\b(?P<name>tern_\w+)\s*\((?P<args>[^)]*)\)$")


def _ctype(decl: str, returned: bool = False) -> object:
    """The ctypes type of one C type (a return type, or a parameter with its name)."""
    decl = re.sub(r"\bconst\b", " ", decl).strip()
    if "*" in decl:
        return ctypes.c_char_p if returned and decl.split("*")[0].strip() == "char" else _vp
    base = decl.split()[0] if returned else " ".join(decl.split()[:-1])
    if base not in _SCALARS:
        raise ValueError(f"tern_kernels.h: no ctypes type for {decl!r}")
    return _SCALARS[base]


@functools.cache
def exported_signatures() -> dict[str, tuple[object, list[object]]]:
    """{name: (restype, argtypes)} of every function in tern_kernels.h's export block."""
    text = HEADER.read_text()
    block = text.split("/* TERN_EXPORTS_BEGIN */")[1].split("/* TERN_EXPORTS_END */")[0]
    block = re.sub(r"/\*.*?\*/", " ", block, flags=re.S)
    signatures = {}
    for statement in block.split(";"):
        statement = " ".join(statement.split())
        if not statement:
            continue
        m = _DECLARATION.match(statement)
        if m is None:
            raise ValueError(f"tern_kernels.h: cannot read the declaration {statement!r}")
        args = [a.strip() for a in m["args"].split(",")]
        argtypes = [] if args == ["void"] else [_ctype(a) for a in args]
        signatures[m["name"]] = (_ctype(m["ret"], returned=True), argtypes)
    return signatures


def _declare(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in exported_signatures().items():
        fn = getattr(lib, name)  # AttributeError: a declared function the build lacks
        fn.restype, fn.argtypes = restype, argtypes


def _check_contract(lib: ctypes.CDLL, t: Tier) -> None:
    if lib.tern_abi_version() != ABI_VERSION:
        raise OSError(f"kernels have ABI {lib.tern_abi_version()}, expected {ABI_VERSION}")
    built = lib.tern_compiled_tier().decode()
    if built != t.name:
        raise OSError(f"the {t.name} build reports tier {built}: its compiler flags are wrong")
    sizes = (ctypes.c_int64 * len(STRUCTS))()
    lib.tern_struct_sizes(sizes)
    for struct, size in zip(STRUCTS, sizes):
        if ctypes.sizeof(struct) != size:
            raise OSError(
                f"{struct.__name__} is {size} bytes in C but {ctypes.sizeof(struct)} in ctypes: "
                "tern_kernels.h and kernel_library.py disagree"
            )


# --------------------------------------------------------------------------- building


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c"))


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def compile_command(t: Tier, out: Path | str, cc: str) -> list[str]:
    return [cc, *_COMMON_FLAGS, *t.cflags, *map(str, sources()), "-o", str(out), "-lm"]


def build(t: Tier, out_dir: Path | None = None) -> Path:
    """The shared library of tier `t`, compiled unless an identical build exists. Raises
    OSError / subprocess.CalledProcessError when it cannot be built."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler (gcc or cc) on PATH")
    key = hashlib.sha256(
        b"\0".join(
            [
                *(p.name.encode() + p.read_bytes() for p in sorted(SOURCE_DIR.iterdir())),
                " ".join(compile_command(t, "", cc)).encode(),
            ]
        )
    ).hexdigest()[:16]
    out_dir = tern_home() / "kernels" if out_dir is None else out_dir
    path = out_dir / f"tern_{t.name}_{key}.so"
    if path.is_file():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: build into a temporary name and rename: several workers may build at the same time.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run(
            compile_command(t, tmp, cc), check=True, capture_output=True, text=True, timeout=300
        )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def load_tier(name: str) -> ctypes.CDLL | None:
    """Tier `name`'s library, built on first use and checked against the contract; None (logged)
    where it cannot be built or loaded. Loading a tier the CPU cannot run is allowed (tests check
    every build's exports); calling into it is not."""
    t = tier(name)
    if platform.system() != "Linux":
        logger.warning("tern's CPU kernels are built on Linux only: pure-torch paths")
        return None
    try:
        lib = ctypes.CDLL(str(build(t)))
        _declare(lib)
        _check_contract(lib, t)
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        logger.warning("cannot build tern's %s kernels (%s) %s: pure-torch paths", name, e, detail)
        return None
    return lib


# --------------------------------------------------------------------------- this process's choice


@functools.cache
def configured_tier() -> Tier | None:
    """The tier TERN_KERNELS and the CPU choose for this process (None: kernels off)."""
    return choose_tier(os.environ.get(ENV_VAR))


_overrides: list[str] = []  # use_tier()'s stack: tests run the kernels of each tier in turn


@contextlib.contextmanager
def use_tier(name: str) -> Iterator[None]:
    """Within the block, `load()` returns tier `name`'s library ("off": None). For tests."""
    if name != "off":
        tier(name)
    _overrides.append(name)
    try:
        yield
    finally:
        _overrides.pop()


def active_tier_name() -> str:
    if _overrides:
        return _overrides[-1]
    t = configured_tier()
    return "off" if t is None else t.name


def load() -> ctypes.CDLL | None:
    """The kernels this process uses, or None: kernels off, or they cannot be built."""
    name = active_tier_name()
    return None if name == "off" else load_tier(name)


def describe() -> str:
    """One line for the start-up log: the tier in use and why."""
    runnable = ", ".join(t.name for t in runnable_tiers()) or "none"
    setting = os.environ.get(ENV_VAR, "auto") or "auto"
    name = active_tier_name()
    if name == "off":
        return f"kernels: off ({ENV_VAR}={setting}; this CPU runs {runnable}): pure-torch paths"
    if load() is None:
        return f"kernels: off (the {name} build failed, see the warning above): pure-torch paths"
    return f"kernels: {name} ({ENV_VAR}={setting}; this CPU runs {runnable})"
