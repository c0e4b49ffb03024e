"""`toolchain probe-host`: measure this host once for the performance model's CPU predictions, and cache it."""

from __future__ import annotations

import json

import click

from toolchain.hostprofile import HostProfile, load_profile, profile_path, save_profile
from toolchain.probe_host import probe_host


def profile_lines(profile: HostProfile, path, fresh: bool) -> list[str]:
    k = profile.key
    curves = profile.gemm_gflops
    lines = [f"host profile ({'measured now' if fresh else 'cached'}, {profile.measured_at}, "
             f"{profile.seconds:.1f} s): {path}",
             f"  cpu: {k.cpu}, {k.cores} core(s); torch {k.torch}; engine threads {k.threads}; engine code {k.engine}",
             f"  memory: {profile.stream_gb_s:.1f} GB/s streamed, {profile.cache_gb_s:.1f} GB/s from the "
             f"{profile.cache_bytes / 2**20:.0f} MiB last-level cache",
             "  linear kernels, GFLOP/s by rows per call:"]
    rows = sorted({r for c in curves.values() for r in c}, key=int)
    lines.append("    " + f"{'':8}" + "".join(f"{r:>9}" for r in rows))
    for name, curve in curves.items():
        lines.append("    " + f"{name:8}" + "".join(f"{curve.get(r, float('nan')):9.1f}" for r in rows))
    lines += [f"  attention: {profile.attention_gb_s:.1f} GB/s of cached K/V (decode), "
              f"{profile.attention_gflops:.1f} GFLOP/s (context)",
              f"  fixed costs: {profile.step_us:.0f} us per step, {profile.layer_us:.0f} us per layer per rank shard, "
              f"{profile.sequence_us:.0f} us per sequence",
              "  gloo: " + (f"{profile.gloo['latency_us']:.0f} us + {profile.gloo['gb_s']:.2f} GB/s between two rank "
                            "processes" + (f"; served beside tritonserver {profile.gloo['served_latency_us']:.0f} us "
                                           "per exchange" if "served_latency_us" in profile.gloo else "")
                            if profile.gloo else "not measured")]
    sv = profile.serving
    lines.append(f"  serving ({sv['protocol']}, the tiny model): {sv['step_us']:.0f} us per step, "
                 f"{sv['sequence_us']:.0f} us per sequence, {sv['request_us']:.0f} us per request"
                 if sv else "  serving: not measured (engine only)")
    lines += [f"  note: {n}" for n in profile.notes]
    return lines


@click.command()
@click.option("--force", is_flag=True, help="Measure again even when a current profile is cached.")
@click.option("--threads", type=click.IntRange(min=0), default=1, show_default=True,
              help="Torch threads the engine runs with (serving.engine_threads; 0: every core).")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
@click.option("--no-serving", is_flag=True, help="Measure the engine only (29 s measured), not what serving adds: "
              "the two served probes deploy the embedded tiny model through tritonserver and bench it, most of "
              "the time a probe takes.")
def command(force: bool, threads: int, as_json: bool, no_serving: bool) -> None:
    """Measure this host once, for the CPU engine's predictions; it takes minutes (measured on a 2-core EPYC
    shared with other jobs: 266 s in all, 29 s with --no-serving).

    Measured: memory bandwidth (streamed and from the last-level cache); the CPU engine's linear kernels per
    precision at 1 to 256 rows per call; its attention (decode and context); a step's fixed costs on the tiny
    model (tp 1 and 2, batch 1 and 8); the gloo exchange between two rank processes; and, unless --no-serving,
    what serving adds: the embedded tiny model deployed through tritonserver and benched at concurrency 1 and 8,
    then its tp-2 ranks under mpirun at concurrency 4.

    The profile is cached under the user's cache directory, keyed by the CPU, cores, torch version, engine threads
    and engine code; `toolchain plan`, `bench` and `tune` predict the CPU engine from it. A cached profile is
    printed without measuring (--force measures again)."""
    profile = None if force else load_profile(threads)
    fresh = profile is None
    if profile is None:
        profile = probe_host(threads, serving=not no_serving,
                             progress=lambda stage, msg: click.echo(f"probing: {msg}" if stage == "probe"
                                                                    else f"probing:   {stage} {msg}", err=True))
        path = save_profile(profile)
    else:
        path = profile_path(profile.key)
    if as_json:
        click.echo(json.dumps({**profile.as_dict(), "path": str(path), "measured_now": fresh}, indent=2))
    else:
        click.echo("\n".join(profile_lines(profile, path, fresh)))
