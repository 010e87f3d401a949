"""Exported plans applied by the libraries themselves: dense save_pretrained -> from_pretrained(quantization_config=...) renders
bit-identical to the lab's own quantisation; what the libraries cannot express is refused; the snippet runs as written."""
import copy, os, re, warnings
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging as dlog
import transformers
from diffq_lab.pipelines import tiny_pipeline, render
from diffq_lab.plan import QuantPlan, apply_plan, plan_linears, to_pipeline_config
from diffq_lab.snippet import export_snippet
from diffq_lab.filters import make_filter_fn
from diffq_lab.filters import quantized_linears
from diffq_lab.text_encoder import prompt_embeddings
from diffq_lab.export import plan_pipeline
from diffq_lab.transformer import denoisers, plan_transformer

warnings.filterwarnings('ignore', message='.*Tensor objects.*')
dlog.disable_progress_bar(); transformers.logging.disable_progress_bar()


def lab_quantised(family, scheme):
    "The dense tiny pipeline, and a copy quantised by the lab (encoders and denoisers, real torchao kernels on this CPU)."
    pipe = tiny_pipeline(family)
    lab = copy.deepcopy(pipe)
    te = plan_pipeline(lab, te_scheme=scheme, family=family, keep=(0, 0), roles=('te',))
    plan = QuantPlan({**te.components, **{a: plan_transformer(m, scheme, min_features=0) for a, m in denoisers(lab).items()}})
    return pipe, lab, apply_plan(lab, plan)


def same(rt, lab, applied):
    assert {c: quantized_linears(getattr(rt, c)) for c in applied.components} == \
           {c: quantized_linears(getattr(lab, c)) for c in applied.components}
    assert torch.equal(render(rt), render(lab))
    assert all(torch.equal(a, b) for a, b in zip(prompt_embeddings(rt), prompt_embeddings(lab)))


@pytest.mark.parametrize('scheme', ['int8', 'int8wo', 'fp8wo'])
@pytest.mark.parametrize('family', ['z-image', 'flux.2-klein', 'sd3', 'qwen-image'])
def test_exported_config_reproduces_the_lab_bit_for_bit(family, scheme, tmp_path):
    pipe, lab, applied = lab_quantised(family, scheme)
    pipe.save_pretrained(tmp_path)
    rt = DiffusionPipeline.from_pretrained(tmp_path, quantization_config=to_pipeline_config(applied), dtype=torch.bfloat16)
    same(rt, lab, applied)


def test_the_snippet_runs_as_written(tmp_path):
    pipe, lab, applied = lab_quantised('flux.2-klein', 'int8')
    pipe.save_pretrained(tmp_path)
    scope = {}
    exec(export_snippet(applied, str(tmp_path)), scope)
    same(scope['pipe'], lab, applied)


def test_what_modules_to_not_convert_cannot_express_goes_per_linear(tmp_path):
    "flux.1's top-level proj_out stays dense under fp8wo, but diffusers matches 'proj_out.' anywhere: exported per Linear instead."
    pipe, lab, applied = lab_quantised('flux.1-dev', 'fp8wo')
    cfg = to_pipeline_config(applied).quant_mapping['transformer']
    assert type(cfg.quant_type).__name__ == 'FqnToConfig' and 'proj_out.weight' not in cfg.quant_type.fqn_to_config
    pipe.save_pretrained(tmp_path)
    same(DiffusionPipeline.from_pretrained(tmp_path, quantization_config=to_pipeline_config(applied), dtype=torch.bfloat16), lab, applied)


@pytest.mark.parametrize('family', ['z-image', 'sd3'])
def test_a_mixed_plan_round_trips_per_linear(pipes, family, tmp_path):
    "A plan that mixes schemes per Linear (as recommend_plan makes), in the denoiser and the encoders, loads bit-identical."
    pipe = pipes[family]
    lab = copy.deepcopy(pipe)
    te = plan_pipeline(lab, te_scheme='int8wo', family=family, keep=(0, 0), roles=('te',))
    comps = {}
    for a, p in {**te.components, **{a: plan_transformer(m, 'int8', min_features=0) for a, m in denoisers(lab).items()}}.items():
        mixed = {f: ('int8wo' if i % 3 else 'fp8wo') if a.startswith('text') else ('int8' if i % 2 else 'fp8wo')
                 for i, f in enumerate(p.quantized)}
        mixed = {f: s for f, s in mixed.items() if s != 'fp8wo' or all(d % 16 == 0 for d in p.linears[f].shape)}
        comps[a] = plan_linears(getattr(lab, a), mixed, make_filter_fn(0), device='cpu')
    applied = apply_plan(lab, QuantPlan(comps))
    assert any(len({l.scheme for l in c.linears.values() if l.scheme}) > 1 for c in applied.components.values())
    pipe.save_pretrained(tmp_path)
    rt = DiffusionPipeline.from_pretrained(tmp_path, quantization_config=to_pipeline_config(applied), dtype=torch.bfloat16)
    same(rt, lab, applied)
    scope = {}
    exec(export_snippet(applied, str(tmp_path)), scope)   # the snippet says the same in code
    same(scope['pipe'], lab, applied)


# ---------------------------------------------------------------- save_quantized / load_quantized
import json, shutil
from diffq_lab.export import SAVED_META, DamagedFolder, file_digests, load_quantized, save_quantized
from diffq_lab.trained import load_trained_pipeline


def saved_as(folder) -> dict:
    "How each quantised component of a saved folder was written: {component: 'safetensors' | 'torch.save'}."
    return {c: s['format'] for c, s in json.loads((folder/SAVED_META).read_text())['saved'].items()}


# wan2.1: its first parameter is an fp32 table kept beside bf16 weights, and its pipeline calls the transformer optional
@pytest.mark.parametrize('family,scheme', [('z-image', 'int8'), ('flux.2-klein', 'int8wo'), ('sd3', 'fp8wo'), ('qwen-image', 'int8'),
                                           ('wan2.1', 'int8')])
def test_a_saved_quantised_pipeline_reloads_bit_identical(family, scheme, tmp_path):
    _, lab, applied = lab_quantised(family, scheme)
    folder = save_quantized(lab, tmp_path/'saved', applied)
    assert saved_as(folder) == {c: 'safetensors' for c in applied.components}   # every library saves every CPU scheme
    for c in applied.components:   # the quantizer attached for the save is gone again: lab is as apply_plan left it
        m = getattr(lab, c)
        assert not hasattr(m, 'hf_quantizer') and getattr(m.config, 'quantization_config', None) is None, c
    back = load_quantized(folder)
    same(back, lab, applied)
    assert all(type(getattr(back, c).get_submodule(f).weight) is type(getattr(lab, c).get_submodule(f).weight)
               for c, p in applied.components.items() for f in p.quantized)


def test_the_trained_pipeline_keeps_its_mixed_dtypes(tmp_path):
    "data/trained with its DiT quantised in bf16 and its encoder dense in fp32: each component reloads in its own dtype."
    lab = load_trained_pipeline()
    lab.text_encoder.float()
    applied = apply_plan(lab, plan_pipeline(lab, 'int8', min_features=0))
    back = load_quantized(save_quantized(lab, tmp_path/'t', applied))
    assert (back.transformer.dtype, back.text_encoder.dtype) == (torch.bfloat16, torch.float32)
    # padded to 32 (the prompt's 14 tokens fit): the reloaded encoder reads 32 tokens in fp32, not ZImagePipeline's 512
    assert torch.equal(render(back, max_sequence_length=32), render(lab, max_sequence_length=32))


@pytest.mark.parametrize('scheme,why', [('nvfp4', 'emulated'), ('fp8_layerwise', 'layerwise-casting hook')])
def test_what_would_reload_as_another_model_is_refused(pipes, scheme, why, tmp_path):
    pipe = copy.deepcopy(pipes['z-image'])
    applied = apply_plan(pipe, plan_pipeline(pipe, scheme, min_features=0))
    with pytest.raises(ValueError, match=why): save_quantized(pipe, tmp_path/'x', applied)
    assert not (tmp_path/'x').exists() and list(tmp_path.iterdir()) == []


def test_a_smoothquant_plan_is_applied_by_the_lab_not_saved_or_expanded(pipes, tmp_path):
    "SmoothQuant's input pre-scales live in no library format: save and expand_plan refuse it, with the way that works."
    from dataclasses import replace
    from diffq_lab.export import expand_plan
    from diffq_lab.plan import Smoothing
    pipe = copy.deepcopy(pipes['z-image'])
    te = plan_linears(pipe.text_encoder, 'int8', make_filter_fn(0), device='cpu')
    sm = Smoothing(0.5, 'a stand-in calibration', {f: torch.ones(te.linears[f].shape[0], dtype=torch.bfloat16) * 4
                                                   for f in te.quantized})
    plan = QuantPlan({'text_encoder': replace(te, smoothing=sm)})
    applied = apply_plan(pipe, QuantPlan.from_json(plan.to_json()))
    assert applied.components['text_encoder'].smoothing == sm and torch.isfinite(render(pipe)).all()
    with pytest.raises(ValueError, match='then apply_plan at load'): save_quantized(pipe, tmp_path/'x', applied)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match='does not expand by role'): expand_plan(plan, 'z-image')


def test_save_refuses_a_plan_that_is_not_the_pipelines(pipes, tmp_path):
    pipe = copy.deepcopy(pipes['z-image'])
    planned = plan_pipeline(pipe, 'int8', min_features=0)
    with pytest.raises(ValueError, match='differ from the plan'): save_quantized(pipe, tmp_path/'x', planned)  # planned, never applied
    with pytest.raises(ValueError, match='empty path'): save_quantized(pipe, '', planned)


def test_load_refuses_a_folder_it_did_not_write(pipes, tmp_path):
    pipes['z-image'].save_pretrained(tmp_path)
    with pytest.raises(ValueError, match='not a folder written by save_quantized'): load_quantized(tmp_path)


def test_a_failed_save_leaves_nothing(pipes, tmp_path, monkeypatch):
    pipe = copy.deepcopy(pipes['z-image'])
    applied = apply_plan(pipe, plan_pipeline(pipe, 'int8', min_features=0))
    def full_disk(*a, **k): raise OSError(28, 'No space left on device')
    import safetensors.torch
    monkeypatch.setattr(torch, 'save', full_disk)
    monkeypatch.setattr(safetensors.torch, 'save_file', full_disk)   # diffusers' writer (module attribute)
    with pytest.raises(OSError, match='(?i)no space left'): save_quantized(pipe, tmp_path/'x', applied)
    assert list(tmp_path.iterdir()) == []


def test_without_its_quantizer_a_torchao_encoder_cannot_be_saved(pipes, tmp_path):
    "Why save_quantized attaches the plan's quantizer: a transformers encoder quantised in place still fails alone."
    lab = copy.deepcopy(pipes['z-image'])
    apply_plan(lab, plan_pipeline(lab, te_scheme='int8', family='z-image', keep=(0, 0), roles=('te',)))
    with pytest.raises(RuntimeError, match='invalid python storage'): lab.text_encoder.save_pretrained(tmp_path)


@pytest.mark.parametrize('component,scheme', [('transformer', 'int8'), ('text_encoder', 'int8wo')])
def test_what_its_library_cannot_save_goes_through_torch_save(pipes, component, scheme, tmp_path, monkeypatch):
    "The fallback path, forced: the component's library fails to save; the manifest says so and why; it reloads bit-identical."
    lab = copy.deepcopy(pipes['z-image'])
    applied = apply_plan(lab, plan_pipeline(lab, scheme, scheme, min_features=0, keep=(0, 0)))
    def cannot(self, *a, **k): raise NotImplementedError('no torchao serialisation here')
    monkeypatch.setattr(type(getattr(lab, component)), 'save_pretrained', cannot)
    folder = save_quantized(lab, tmp_path/'s', applied)
    monkeypatch.undo()
    how = json.loads((folder/SAVED_META).read_text())['saved']
    assert saved_as(folder) == {'text_encoder': 'safetensors', 'transformer': 'safetensors', component: 'torch.save'}
    assert 'cannot save it (NotImplementedError: no torchao serialisation here)' in how[component]['why']
    assert sorted(p.name for p in (folder/component).iterdir()) == ['config.json', 'diffq_quantized.pt']
    back = load_quantized(folder)
    assert torch.equal(render(back, steps=1), render(lab, steps=1))
    # a /2 folder (every quantised component a torch state dict, no "saved") still loads
    if component == 'transformer':
        shutil.rmtree(folder/'text_encoder'); shutil.copytree(folder/'transformer', tmp_path/'keep')
        lab.text_encoder.config.save_pretrained(folder/'text_encoder')
        torch.save(lab.text_encoder.state_dict(), folder/'text_encoder'/'diffq_quantized.pt')
        meta = json.loads((folder/SAVED_META).read_text())
        meta.update(format='diffq_lab.quantized/2', files=file_digests(folder)); del meta['saved']
        (folder/SAVED_META).write_text(json.dumps(meta))
        assert torch.equal(render(load_quantized(folder), steps=1), render(lab, steps=1))


def forge(folder, edit):
    "A forger's edit: `edit(folder)`, then every file re-hashed so only the loader's other checks stand."
    edit(folder)
    meta = json.loads((folder/SAVED_META).read_text()); meta['files'] = file_digests(folder)
    (folder/SAVED_META).write_text(json.dumps(meta))


@pytest.fixture(scope='module')
def two_saves(tmp_path_factory):
    "The tiny z-image, int8 throughout, saved twice: from two seeds (same names, other weights)."
    from diffq_lab.pipelines import tiny_pipeline
    out = []
    for seed in (0, 1):
        pipe = tiny_pipeline('z-image', seed=seed)
        applied = apply_plan(pipe, plan_pipeline(pipe, 'int8', 'int8', min_features=0, keep=(0, 0)))
        out.append(save_quantized(pipe, tmp_path_factory.mktemp('saves')/f'z{seed}', applied))
    return out


def one_line_error(folder) -> str:
    with pytest.raises(DamagedFolder) as e: load_quantized(folder)
    assert '\n' not in str(e.value), str(e.value)
    return str(e.value)


WEIGHTS = 'transformer/diffusion_pytorch_model.safetensors'

def set_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

@pytest.mark.parametrize('edit,says', [
    (lambda f, o: shutil.copy(o/WEIGHTS, f/WEIGHTS), 'reloads (safetensors) with other tensors than were saved'),
    (lambda f, o: set_json(f/'transformer'/'config.json', quantization_config={'quant_method': 'bitsandbytes'}),
     'has no torchao quantization_config'),
    (lambda f, o: set_json(f/SAVED_META, saved={'transformer': {'format': 'pickle'}}), '"saved" must say'),
])
def test_a_forged_folder_that_re_hashes_its_files_is_still_refused(two_saves, tmp_path, edit, says):
    f = tmp_path/'f'; shutil.copytree(two_saves[0], f)
    forge(f, lambda f: edit(f, two_saves[1]))
    assert says in one_line_error(f)


def test_the_tree_is_checked_against_the_manifest_in_one_line(two_saves, tmp_path):
    "Every entry it did not write named at once: a nested manifest, a link to a file, a link to a folder, an empty folder."
    f = tmp_path/'f'; shutil.copytree(two_saves[0], f)
    shutil.copy(f/SAVED_META, f/'transformer'/SAVED_META)
    (f/'vae'/'config.json').rename(f/'vae'/'real.json'); (f/'vae'/'config.json').symlink_to(f/'vae'/'real.json')
    (f/'elsewhere').symlink_to(two_saves[1], target_is_directory=True); (f/'tokenizer'/'cache').mkdir()
    msg = one_line_error(f)
    for part in ('elsewhere (a symbolic link to a folder)', 'tokenizer/cache (folder)', 'transformer/diffq_saved.json',
                 'vae/config.json (a symbolic link)', 'vae/real.json', 'were not written by save_quantized'):
        assert part in msg, msg
