"""Cost of an emulated Linear vs the bf16 Linear it replaces (a benchmark, not a test).

    .venv/bin/python bench/emulate_cost.py [--device cpu] [--m 1024] [--k 4096] [--n 4096] [--reps 9] [--threads 1] [--compile]

Prints, per scheme, the forward time of `EmulatedLinear.from_linear(linear, scheme)` and its ratio to
the bf16 `nn.Linear` forward on the same input. The weight is fake-quantised once at construction, so
a forward is one activation fake-quant plus a matmul in the compute dtype; the issue's budget is ~3x
the bf16 forward at 4096x4096, M=1024. The two modules are timed alternately and each keeps its
fastest run, so that other jobs on a shared machine slow both alike (the minimum is the cost of the
work; the median would measure the neighbours). With --compile it also times torch.compile'd modules
and prints how many bf16 ulps the compiled output moves from eager. Timings carry the device.
"""
import argparse, time
import torch
from torch import nn
from diffq_lab.core import device_name, resolve_device
from diffq_lab.emulate import EMULATIONS, EmulatedLinear, compare_outputs


def _sync(device):
    if device.type == 'cuda': torch.cuda.synchronize(device)


def fastest_pair(f, g, x, device, reps: int, warmup: int = 2) -> tuple[float, float]:
    "The fastest of `reps` runs of `f(x)` and of `g(x)`, run alternately after `warmup` runs of each."
    best_f = best_g = float('inf')
    with torch.inference_mode():
        for _ in range(warmup): f(x); g(x)
        _sync(device)
        for _ in range(reps):
            for which, fn in (('f', f), ('g', g)):
                t0 = time.perf_counter(); fn(x); _sync(device)
                dt = time.perf_counter() - t0
                if which == 'f': best_f = min(best_f, dt)
                else: best_g = min(best_g, dt)
    return best_f, best_g


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--device', default=None)
    p.add_argument('--m', type=int, default=1024)
    p.add_argument('--k', type=int, default=4096)
    p.add_argument('--n', type=int, default=4096)
    p.add_argument('--reps', type=int, default=9)
    p.add_argument('--schemes', nargs='*', default=list(EMULATIONS))
    p.add_argument('--compile', action='store_true', help='also time torch.compile(EmulatedLinear)')
    p.add_argument('--threads', type=int, default=None, help='torch CPU threads (1 is steadier on a shared machine)')
    a = p.parse_args(argv)
    if a.threads: torch.set_num_threads(a.threads)
    device = resolve_device(a.device)
    torch.manual_seed(0)
    linear = nn.Linear(a.k, a.n, dtype=torch.bfloat16, device=device)
    x = torch.randn(a.m, a.k, dtype=torch.bfloat16, device=device)
    print(f'# {device_name(device)}, torch {torch.__version__}, threads {torch.get_num_threads()}, '
          f'M={a.m} K={a.k} N={a.n}, fastest of {a.reps} alternating runs')
    print(f'{"scheme":<14}{"bf16_s":>9}{"emulated_s":>12}{"ratio":>7}'
          + (f'{"compiled_s":>12}{"ratio":>7}{"ulps_vs_eager":>15}' if a.compile else ''))
    worst = 0.0
    for scheme in a.schemes:
        m = EmulatedLinear.from_linear(linear, scheme)
        base, t = fastest_pair(linear, m, x, device, a.reps)
        worst = max(worst, t / base)
        line = f'{scheme:<14}{base:>9.4f}{t:>12.4f}{t / base:>7.2f}'
        if a.compile:
            try:
                cm = torch.compile(m)
                base_c, tc = fastest_pair(linear, cm, x, device, a.reps)
                # inductor keeps some intermediates in fp32 where eager (and torchao) round to bf16: show how far that moves
                with torch.inference_mode(): drift = compare_outputs(cm(x), m(x))['ulps']
                line += f'{tc:>12.4f}{tc / base_c:>7.2f}{drift:>15.2f}'
            except Exception as e:  # report, don't hide: compile support is optional
                line += f'  compile failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}'
        print(line, flush=True)
    print(f'worst ratio {worst:.2f} (budget ~3x)')


if __name__ == '__main__':
    main()
