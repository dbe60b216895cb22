"""The kernels' one contract (csrc/tern_kernels.h) and their tiers (kernel_library.py).

- Every tier compiles on any machine, whatever its CPU: a syntax or type error in a tier this
  machine cannot run still fails here; each build exports every function the header declares.
- The ctypes signatures come from the header; the structs' sizes agree between C and ctypes.
- TERN_KERNELS picks a tier and refuses one the CPU cannot run. (`off` for a whole server:
  tests/integration/test_kernels_off.py; the in-process HF checks under `off` and `avx2`:
  tests/unit/test_model_runner.py.)
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.kernels import kernel_library as kl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def builds() -> dict[str, Path]:
    """Every tier's library, built where tern loads them from (TERN_HOME/kernels): a build is
    named by the hash of the sources and its compile command, so an edited source compiles again,
    and the tiers this CPU runs are not compiled a second time when the servers and tests of the
    run load them."""
    if kl.compiler() is None:
        pytest.skip("no C compiler")
    tiers = kl.all_tiers()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:  # compilers: processes
        return dict(zip([t.name for t in tiers], pool.map(kl.build, tiers)))


def test_every_tier_compiles_and_exports_the_header(builds: dict[str, Path]) -> None:
    names = list(kl.exported_signatures())
    assert len(names) >= 25 and "tern_decode_layer_bf16" in names
    for tier_name, path in builds.items():
        lib = ctypes.CDLL(str(path))  # loading runs none of the tier's instructions
        missing = [n for n in names if not hasattr(lib, n)]
        assert not missing, f"the {tier_name} build lacks {missing}"


def test_builds_this_cpu_runs_report_their_tier_and_struct_sizes(builds: dict[str, Path]) -> None:
    runnable = kl.runnable_tiers()
    assert runnable[0].name == "baseline"
    for t in runnable:
        lib = kl.load_tier(t.name)
        assert lib is not None, t.name
        assert lib.tern_compiled_tier().decode() == t.name
        assert lib.tern_abi_version() == kl.ABI_VERSION
        sizes = (ctypes.c_int64 * 3)()
        lib.tern_struct_sizes(sizes)
        assert list(sizes) == [ctypes.sizeof(s) for s in kl.STRUCTS]


def test_signatures_are_read_from_the_header() -> None:
    sigs = kl.exported_signatures()
    restype, argtypes = sigs["tern_shm_all_reduce"]
    assert restype is ctypes.c_int
    assert argtypes == [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double,
    ]  # fmt: skip
    assert sigs["tern_compiled_tier"] == (ctypes.c_char_p, [])
    assert sigs["tern_rms_norm"][0] is None  # void
    assert sigs["tern_rms_norm"][1][-1] is ctypes.c_float


def test_tier_choice() -> None:
    avx2_only = kl.tier("avx2").cpu_flags
    assert kl.choose_tier("off", avx2_only) is None
    assert kl.choose_tier(None, avx2_only).name == "avx2"
    assert kl.choose_tier("auto", avx2_only | kl.tier("amx").cpu_flags).name == "amx"
    assert kl.choose_tier("baseline", avx2_only).name == "baseline"
    with pytest.raises(ValueError, match="cannot run that tier.*avx512"):
        kl.choose_tier("avx512_bf16", avx2_only)
    with pytest.raises(ValueError, match="unknown kernel tier"):
        kl.choose_tier("sse9", avx2_only)


def test_use_tier_switches_the_library() -> None:
    with kl.use_tier("off"):
        assert kl.load() is None and kl.active_tier_name() == "off"
    with kl.use_tier("baseline"):
        assert kl.load().tern_compiled_tier() == b"baseline"
    assert kl.active_tier_name() == kl.configured_tier().name


def test_a_tier_the_cpu_lacks_is_a_clear_start_up_error(tmp_path: Path) -> None:
    missing = [t for t in kl.all_tiers() if t not in kl.runnable_tiers()]
    if not missing:
        pytest.skip("this CPU runs every tier")
    code = "from workers.kernels import kernel_library as k; k.load()"
    env = {**os.environ, "TERN_KERNELS": missing[-1].name}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode != 0 and "cannot run that tier" in r.stderr
