"Quiet imports: the known harmless torchao / torch / diffusers messages are filtered where the lab is imported, and only those."
import functools, os, re, subprocess, sys, tempfile
from pathlib import Path
import pytest

# The lines issue #16 measured ahead of every report (torchao 0.17/0.18, torch 2.13, diffusers 0.42).
NOISE = [r'Failed to load \S*_C_mxfp8', r'Failed to load \S*_C_cutlass_90a',
         r'is an Enum subclass and is now natively supported by torch\.compile',
         r'Unable to import `torchao` Tensor objects',
         r'ImageProcessor` requires torchvision \(not installed\); falling back']  # transformers 5, flux.1's processors

# Import the lab, then everything that logs the noise (torchao itself, diffusers' torchao quantizer), then
# provoke genuine messages: a warning of the lab's own and an unrelated record on torchao's logger.
SCRIPT = '''
import diffq_lab.core, diffq_lab.study
import logging, torch, torchao
import diffusers.quantizers.torchao.torchao_quantizer
from diffq_lab.plan import plan_linears
plan_linears(torch.nn.Sequential(torch.nn.Linear(8, 8)), "int8")
from diffq_lab.pipelines import tiny_pipeline
tiny_pipeline("flux.1")  # CLIP and Siglip image processors: transformers' torchvision fallback lines
logging.getLogger("transformers.utils.import_utils").warning("a genuine transformers warning")
logging.getLogger("torchao").warning("Failed to load /elsewhere/_C_other.so: a genuine torchao warning")
logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").warning("a genuine diffusers warning")
print("done")
'''

CONTROL = '''
import torch, torchao
import diffusers.quantizers.torchao.torchao_quantizer
'''

def _run(args, **kw):
    env = {**os.environ, 'DIFFQ_LAB_CACHE': tempfile.mkdtemp(prefix='diffq_quiet_'), 'HF_HUB_OFFLINE': '1'}
    env.pop('PYTHONWARNINGS', None)
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, **kw)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr

def _noise(out: str) -> list[str]:
    return [l for l in out.splitlines() if any(re.search(p, l) for p in NOISE)]

def test_control_shows_the_noise():
    "Without the lab, the same imports print the messages (else the libraries changed and the filters are moot)."
    out = _run([sys.executable, '-c', CONTROL])
    if not _noise(out): pytest.skip('the installed torchao/torch/diffusers print none of the known messages')
    import torch
    if torch.cuda.is_available(): return  # the kernel libraries may load on a GPU (and are then not filtered)
    assert any('_C_mxfp8' in l for l in _noise(out)), out

@functools.cache
def _lab_run() -> str:
    """One fresh python for the two checks that import the lab (a python importing it costs ~6 CPU-s): the README's
    snippet first, verbatim, so the lab is imported before diffusers as the README does it; then SCRIPT, whose noise
    comes from what it calls and imports after (torchao, diffusers' torchao quantizer, flux.1's processors) and whose
    genuine messages are its own. Each test reads the whole output."""
    return _run([sys.executable, '-c', SNIPPET + SCRIPT])

def test_import_is_quiet_and_genuine_warnings_show():
    out = _lab_run()
    assert _noise(out) == [], '\n'.join(_noise(out))
    assert 'none of the 1 Linears qualifies' in out, out   # the lab's own UserWarning
    assert 'a genuine torchao warning' in out, out          # the same logger, another message
    assert 'a genuine diffusers warning' in out, out
    assert 'a genuine transformers warning' in out, out
    assert 'done' in out, out

def test_probe_prints_nothing_before_its_report():
    exe = Path(sys.executable).parent/'diffq-lab'
    out = _run([str(exe), 'probe'])
    assert out.startswith('**'), out[:2000]
    assert _noise(out) == [], '\n'.join(_noise(out))

# The README's snippet, in its order: the lab imported before diffusers (which loads torchao on import).
SNIPPET = '''
import tempfile, torch
from diffq_lab.pipelines import tiny_pipeline
from diffq_lab.plan import plan_linears, to_pipeline_config
from diffusers import DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained  # the user's own loading code
plan_linears(tiny_pipeline('z-image').transformer, 'int8')
print(to_pipeline_config is not None)
'''

def test_readme_snippet_is_quiet():
    out = _lab_run()
    assert _noise(out) == [], '\n'.join(_noise(out))
    assert 'True' in out, out
