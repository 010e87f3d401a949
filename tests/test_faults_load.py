"""Issue 27 items 1-2, as fault injection: a saved folder never runs code and names every damaged, swapped or forged file in
one line; a plan from a file is checked against a schema, and against the live model and this machine when applied."""
import copy, json, os, shutil, sys
os.environ.setdefault('HF_HUB_OFFLINE', '1')
from pathlib import Path
import pytest
import torch
from diffq_lab.export import DamagedFolder, file_digests, load_quantized, plan_pipeline, save_quantized
from diffq_lab.pipelines import render, tiny_pipeline
from diffq_lab.plan import QuantPlan, apply_plan, plan_linears, to_pipeline_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    "A tiny z-image quantised int8 (encoder and transformer) and saved; tests copy it before they damage it."
    pipe = tiny_pipeline('z-image')
    plan = apply_plan(pipe, plan_pipeline(pipe, 'int8', 'int8', min_features=0, keep=(0, 0)))
    return save_quantized(pipe, tmp_path_factory.mktemp('saved')/'z-int8', plan)


def copy_of(saved, tmp_path, name='copy') -> Path:
    dst = tmp_path/name; shutil.copytree(saved, dst); return dst

def reforge(folder: Path):
    "What a forger does after editing a folder: rewrite the digests, so only the allow-list and the checks stand."
    meta = json.loads((folder/'diffq_saved.json').read_text()); meta['files'] = file_digests(folder)
    (folder/'diffq_saved.json').write_text(json.dumps(meta))

def one_line(e) -> str:
    msg = str(e.value); assert '\n' not in msg, msg; return msg


def test_a_folder_naming_its_own_payload_never_runs_it(saved, tmp_path, monkeypatch):
    """The case that ran foreign code: model_index names <folder>.transformer.payload, loaded from the folder's parent.
    As a user's `python` there runs it (the working folder first on sys.path), in this process: no second import of the lab."""
    f = copy_of(saved, tmp_path, 'evil')
    (f/'__init__.py').write_text(''); (f/'transformer'/'__init__.py').write_text('')
    (f/'transformer'/'payload.py').write_text("open('PAYLOAD_RAN', 'w').write('ran')\nclass X: pass\n")
    idx = json.loads((f/'model_index.json').read_text()); idx['transformer'] = ['evil.transformer.payload', 'X']
    (f/'model_index.json').write_text(json.dumps(idx)); reforge(f)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, 'path', ['.', *sys.path])
    try:
        with pytest.raises(ValueError) as e: load_quantized('evil')
    finally:
        for m in [m for m in sys.modules if m == 'evil' or m.startswith('evil.')]: del sys.modules[m]  # had it run
    assert 'may name only diffusers, transformers' in str(e.value), str(e.value)
    assert not (tmp_path/'PAYLOAD_RAN').exists()


@pytest.mark.parametrize('library,cls,says', [('os', 'system', 'may name only'), ('diffq_lab.cli', 'main', 'may name only'),
                                               ('diffusers', 'logging', 'not a diffusers model'),
                                               ('transformers', '__builtins__', 'not a class name'),
                                               ('diffusers', 'DiffusionPipeline', 'not a diffusers model')])
def test_index_entries_outside_the_allow_list_are_named(saved, tmp_path, library, cls, says):
    f = copy_of(saved, tmp_path)
    idx = json.loads((f/'model_index.json').read_text()); idx['vae'] = [library, cls]
    (f/'model_index.json').write_text(json.dumps(idx)); reforge(f)
    with pytest.raises(DamagedFolder) as e: load_quantized(f)
    assert says in one_line(e)


def test_the_pipeline_class_must_be_a_diffusers_pipeline(saved, tmp_path):
    f = copy_of(saved, tmp_path)
    idx = json.loads((f/'model_index.json').read_text()); idx['_class_name'] = 'AutoencoderKL'
    (f/'model_index.json').write_text(json.dumps(idx)); reforge(f)
    with pytest.raises(DamagedFolder) as e: load_quantized(f)
    assert 'not a diffusers pipeline' in one_line(e)


def swap_weights_from_another_save(f: Path, tmp_path):
    other = tiny_pipeline('z-image', seed=1)
    plan = apply_plan(other, plan_pipeline(other, 'int8', 'int8', min_features=0, keep=(0, 0)))
    o = save_quantized(other, tmp_path/'other', plan)
    shutil.copy(o/'transformer'/'diffusion_pytorch_model.safetensors', f/'transformer'/'diffusion_pytorch_model.safetensors')

@pytest.mark.parametrize('damage,names', [
    (lambda f, t: swap_weights_from_another_save(f, t), 'transformer/diffusion_pytorch_model.safetensors differs'),
    (lambda f, t: shutil.copy(f/'vae'/'config.json', f/'transformer'/'config.json'), 'transformer/config.json differs'),
    (lambda f, t: (f/'diffq_plan.json').write_text((f/'diffq_plan.json').read_text()[:50]), 'diffq_plan.json differs'),
    (lambda f, t: (f/'text_encoder'/'config.json').unlink(), 'text_encoder/config.json is missing'),
    (lambda f, t: (f/'transformer'/'extra.safetensors').write_bytes(b'x'), 'extra.safetensors was not written by save_quantized'),
    (lambda f, t: (f/'diffq_saved.json').write_text('{"format": "diffq_lab.quan'), 'diffq_saved.json is not valid JSON'),
])
def test_every_damaged_or_swapped_file_is_named(saved, tmp_path, damage, names):
    f = copy_of(saved, tmp_path)
    damage(f, tmp_path)
    with pytest.raises(ValueError) as e: load_quantized(f)
    assert names in one_line(e)


@pytest.mark.parametrize('quantized', [['../../etc'], 'transformer', [7]])
def test_quantized_names_only_components_of_the_index(saved, tmp_path, quantized):
    f = copy_of(saved, tmp_path)
    meta = json.loads((f/'diffq_saved.json').read_text()); meta['quantized'] = quantized
    (f/'diffq_saved.json').write_text(json.dumps(meta))
    with pytest.raises(DamagedFolder) as e: load_quantized(f)
    assert '"quantized" must list components' in one_line(e)


def test_a_component_named_as_a_path_is_refused(saved, tmp_path):
    f = copy_of(saved, tmp_path)
    idx = json.loads((f/'model_index.json').read_text()); idx['../../outside'] = idx['vae']
    (f/'model_index.json').write_text(json.dumps(idx)); reforge(f)
    with pytest.raises(DamagedFolder) as e: load_quantized(f)
    assert 'is not a component name' in one_line(e)


def test_forged_weights_that_do_not_fit_the_config_are_named(saved, tmp_path):
    f = copy_of(saved, tmp_path)
    cfg = json.loads((f/'transformer'/'config.json').read_text()); cfg['n_layers'] = cfg['n_layers'] + 1
    (f/'transformer'/'config.json').write_text(json.dumps(cfg)); reforge(f)
    with pytest.raises(DamagedFolder) as e: load_quantized(f)
    assert 'does not fit' in one_line(e)


def test_the_untouched_folder_still_loads(saved):
    pipe = load_quantized(saved)
    assert torch.isfinite(render(pipe, steps=1)).all()


# ---- plans from files ----

def two_linears():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512, dtype=torch.bfloat16), torch.nn.Linear(512, 512, dtype=torch.bfloat16))

@pytest.mark.parametrize('doc,says', [
    ({'version': 1, 'components': {'transformer': {'linears': []}}}, 'expected {"linears"'),
    ({'version': 1, 'components': {'transformer': 'int8'}}, 'expected {"linears"'),
    ({'version': 1, 'components': {'transformer': {'linears': {'0': ['int8', 'foo', '', 512, 512]}}}}, "not 'foo'"),
    ({'version': 1, 'components': {'transformer': {'linears': {'0': ['int9', 'torchao', '', 512, 512]}}}}, 'int9'),
    ({'version': 1, 'components': {'transformer': {'linears': {'0': [None, 'torchao', '', 512, 512]}}}}, 'no backend'),
    ({'version': 1, 'components': {'transformer': {'linears': {'0': ['int8', 'torchao', '', -1, 512]}}}}, 'integers'),
    ({'version': 1, 'components': {'../x': {'linears': {}}}}, 'not a component name'),
    ({'version': 2, 'components': {}}, 'version 1'),
])
def test_a_plan_file_is_checked_against_the_schema(doc, says, tmp_path):
    (tmp_path/'p.json').write_text(json.dumps(doc))
    with pytest.raises(ValueError) as e: QuantPlan.load(tmp_path/'p.json')
    assert says in one_line(e) and 'p.json' in str(e.value)

def test_deep_or_broken_json_is_one_line(tmp_path):
    for text in ('[' * 100_000 + ']' * 100_000, '{"version": 1, "comp'):
        (tmp_path/'p.json').write_text(text)
        with pytest.raises(ValueError) as e: QuantPlan.load(tmp_path/'p.json')
        assert 'not JSON' in one_line(e)

def test_a_gpu_made_mxfp8_plan_is_emulated_here_not_failed_later():
    "Made where torchao's MXFP8 kernel runs (backend 'torchao'): applied on this CPU, where it does not, it is emulated."
    m = two_linears()
    d = {'version': 1, 'components': {'': {'linears': {'0': ['mxfp8', 'torchao', '', 512, 512], '1': [None, None, 'dense', 512, 512]}}}}
    ran = apply_plan(m, QuantPlan.from_dict(d))
    if torch.cuda.is_available(): pytest.skip('this check is about a machine without the kernel')
    assert ran.components[''].backend == 'emulate' and 'planned via torchao' in ran.components[''].linears['0'].reason
    assert torch.isfinite(m(torch.randn(4, 512, dtype=torch.bfloat16))).all()

def test_a_plan_for_another_model_is_refused():
    m = two_linears()
    d = plan_linears(two_linears(), 'int8', device='cpu')
    bad = QuantPlan.from_dict({'version': 1, 'components': {'': {'linears': {
        **{f: [l.scheme, l.backend, l.reason, *l.shape] for f, l in d.linears.items()}, '1': [None, None, 'dense', 256, 512]}}}})
    with pytest.raises(ValueError, match=r"'1' is \(512, 512\), the plan says \(256, 512\)"): apply_plan(m, bad)
    extra = QuantPlan.from_dict({'version': 1, 'components': {'': {'linears': {'0': ['int8', 'torchao', '', 512, 512]}}}})
    with pytest.raises(ValueError, match='the plan is for another model'): apply_plan(two_linears(), extra)

def test_a_component_diffusers_would_ignore_is_refused_on_export():
    p = plan_linears(two_linears(), 'int8', device='cpu')
    with pytest.raises(ValueError, match='diffusers applies a quantisation config only to'): to_pipeline_config(QuantPlan({'foo': p}))
