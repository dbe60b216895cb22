"""Speech in, measured: the real-time factor (seconds of audio transcribed per wall second) of
/v1/audio/transcriptions at concurrency 1 and 8, on any OpenAI-compatible server (tern, vLLM), on
random Whisper checkpoints of whisper-tiny's and whisper-base's sizes (scripts/make_tiny_whisper.py).

    python scripts/make_tiny_whisper.py /tmp/whisper-tiny --shape tiny
    python scripts/bench_audio.py --base-url http://127.0.0.1:8000 --label tern \
        --result-file docs/bench_results/audio_tern_tiny.json

Each request is its own 30 s file (distinct audio: no cache hit anywhere), 16 kHz mono wav,
language en, greedy, `max_completion_tokens` tokens (default 96, about what 30 s of speech
transcribes to: a random checkpoint rarely ends by itself); json, or with --granularities
verbose_json timed at those (segment, word: what word timestamps cost). Reported: RTF, the median request
latency, failed requests (must be none), and the CPU (lscpu's model name and flags).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import platform
import statistics
import subprocess
import time
import wave
from pathlib import Path
from typing import Any

import httpx
import numpy as np

SAMPLE_RATE = 16000
SECONDS = 30.0


def speech_like(seed: int, seconds: float = SECONDS) -> bytes:
    """A 16-bit mono wav of gliding tones and noise, different for every seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(SAMPLE_RATE * seconds)) / SAMPLE_RATE
    freq = rng.uniform(150, 900) * (1 + 0.3 * np.sin(2 * np.pi * rng.uniform(0.1, 0.5) * t))
    samples = 0.3 * np.sin(2 * np.pi * np.cumsum(freq) / SAMPLE_RATE)
    samples += 0.05 * rng.standard_normal(t.size)
    pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


async def transcribe(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    audio: bytes,
    max_tokens: int,
    granularities: list[str],
) -> tuple[float, str | None]:
    """(seconds, error or None). With granularities: verbose_json timed at those."""
    start = time.perf_counter()
    data: dict[str, Any] = {"model": model, "language": "en", "temperature": "0",
                            "max_completion_tokens": str(max_tokens)}  # fmt: skip
    if granularities:
        data["response_format"] = "verbose_json"
        data["timestamp_granularities[]"] = granularities
    try:
        r = await client.post(url, files={"file": ("a.wav", audio, "audio/wav")}, data=data)
        error = None if r.status_code == 200 else f"{r.status_code}: {r.text[:200]}"
    except httpx.HTTPError as e:
        error = repr(e)
    return time.perf_counter() - start, error


async def run_level(
    base_url: str,
    model: str,
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    seed: int,
    granularities: list[str],
) -> dict[str, Any]:
    url = f"{base_url}/v1/audio/transcriptions"
    files = [speech_like(seed + i) for i in range(num_requests)]
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for f in files:
        queue.put_nowait(f)
    latencies: list[float] = []
    errors: list[str] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            audio = queue.get_nowait()
            seconds, error = await transcribe(client, url, model, audio, max_tokens, granularities)
            latencies.append(seconds)
            if error is not None:
                errors.append(error)

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "audio_seconds": num_requests * SECONDS,
        "wall_s": round(wall, 3),
        "rtf": round(num_requests * SECONDS / wall, 2),
        "median_latency_s": round(statistics.median(latencies), 3),
        "failed": len(errors),
        "errors": errors[:3],
    }


def cpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return {"model": platform.processor(), "flags": ""}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    kept = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    return {"model": fields.get("Model name", "").strip(), "flags": " ".join(kept)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--model", default=None, help="the served name (default: /v1/models' first)"
    )
    parser.add_argument("--label", default="server")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--levels", default="1:4,8:16", help="concurrency:requests, ...")
    parser.add_argument(
        "--granularities", default="",
        help="timestamp_granularities, comma-separated (segment, word): verbose_json answers",
    )  # fmt: skip
    parser.add_argument("--result-file", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or httpx.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
    granularities = [g for g in args.granularities.split(",") if g]
    # One request first: the servers' start-up work (first encoder call, compiled kernels).
    asyncio.run(run_level(args.base_url, model, 1, 1, args.max_tokens, 10_000, granularities))
    results = []
    for level in args.levels.split(","):
        c, n = (int(x) for x in level.split(":"))
        results.append(
            asyncio.run(run_level(args.base_url, model, c, n, args.max_tokens, 0, granularities))
        )
        r = results[-1]
        print(f"{args.label} c={c}: RTF {r['rtf']}x ({r['requests']} x 30 s in {r['wall_s']} s), "
              f"median latency {r['median_latency_s']} s, failed {r['failed']}")  # fmt: skip
    record = {"label": args.label, "model": model, "max_tokens": args.max_tokens, "cpu": cpu(),
              "granularities": granularities, "levels": results}  # fmt: skip
    if args.result_file is not None:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
