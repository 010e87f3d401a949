"""Cost of an emulated Linear vs the bf16 Linear it replaces (a benchmark, not a test).

    .venv/bin/python bench/emulate_cost.py [--device cpu] [--m 1024] [--k 4096] [--n 4096] [--reps 9] [--threads 1] [--compile]

Prints, per scheme, the forward time of `EmulatedLinear.from_linear(linear, scheme)` and its ratio to
the bf16 `nn.Linear` forward on the same input. The weight is fake-quantised once at construction, so
a forward is one activation fake-quant plus a matmul in the compute dtype; the issue's budget is ~3x
the bf16 forward at 4096x4096, M=1024. The two modules are timed paired, as every speed comparison of
the lab (`diffq_lab.stats`): warmed up, then interleaved in ABBA rounds, and the cost is the median of
the per-round ratios with its BCa interval; a verdict says when the interval is too wide to read (a
neighbour process on a shared machine). With --compile it also times torch.compile'd modules and prints
how many bf16 ulps the compiled output moves from eager. Timings carry the device.
"""
import argparse, statistics
import torch
from torch import nn
from diffq_lab.core import device_name, resolve_device
from diffq_lab.emulate import EMULATIONS, EmulatedLinear
from diffq_lab.agreement import compare_outputs
from diffq_lab.stats import interleaved_times, speed_vs, warm_up


def paired_cost(f, g, x, device, rounds: int) -> dict:
    "g's time over f's on `x`: the median paired ratio over `rounds` interleaved rounds, its interval and how to read it."
    def call(fn):
        def go():
            with torch.inference_mode(): fn(x)
        return go
    fns = {'f': call(f), 'g': call(g)}
    warm_up(fns, device)
    ts = interleaved_times(fns, rounds, device)
    sp = speed_vs(ts['f'], ts['g'])  # f's time over g's: > 1 when g is faster
    return dict(f_s=statistics.median(ts['f']), g_s=statistics.median(ts['g']), cost=1 / sp['ratio'], cost_lo=1 / sp['ratio_hi'],
                cost_hi=1 / sp['ratio_lo'], verdict=sp['verdict'])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--device', default=None)
    p.add_argument('--m', type=int, default=1024)
    p.add_argument('--k', type=int, default=4096)
    p.add_argument('--n', type=int, default=4096)
    p.add_argument('--reps', type=int, default=9, help='interleaved rounds (>= 5 for an interval)')
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
          f'M={a.m} K={a.k} N={a.n}, median of {a.reps} interleaved rounds; cost = emulated / bf16 time with its 95% interval')
    print(f'{"scheme":<14}{"bf16_s":>9}{"emulated_s":>12}{"cost":>7}{"interval":>16}  verdict'
          + (f'{"compiled_s":>12}{"cost":>7}{"ulps_vs_eager":>15}' if a.compile else ''))
    worst = 0.0
    for scheme in a.schemes:
        m = EmulatedLinear.from_linear(linear, scheme)
        c = paired_cost(linear, m, x, device, a.reps)
        worst = max(worst, c['cost'])
        line = f"{scheme:<14}{c['f_s']:>9.4f}{c['g_s']:>12.4f}{c['cost']:>7.2f}  [{c['cost_lo']:.2f}, {c['cost_hi']:.2f}]  {c['verdict']}"
        if a.compile:
            try:
                cm = torch.compile(m)
                cc = paired_cost(linear, cm, x, device, a.reps)
                # inductor keeps some intermediates in fp32 where eager (and torchao) round to bf16: show how far that moves
                with torch.inference_mode(): drift = compare_outputs(cm(x), m(x))['ulps']
                line += f"{cc['g_s']:>12.4f}{cc['cost']:>7.2f}{drift:>15.2f}"
            except Exception as e:  # report, don't hide: compile support is optional
                line += f'  compile failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}'
        print(line, flush=True)
    print(f'worst ratio {worst:.2f} (budget ~3x)')


if __name__ == '__main__':
    main()
