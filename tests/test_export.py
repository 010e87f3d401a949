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
from diffq_lab.plan import QuantPlan, apply_plan, export_snippet, plan_linears, to_pipeline_config
from diffq_lab.schemes import make_filter_fn
from diffq_lab.schemes import quantized_linears
from diffq_lab.text_encoder import plan_text_encoders, prompt_embeddings
from diffq_lab.transformer import denoisers, plan_transformer

warnings.filterwarnings('ignore', message='.*Tensor objects.*')
dlog.disable_progress_bar(); transformers.logging.disable_progress_bar()


def lab_quantised(family, scheme):
    "The dense tiny pipeline, and a copy quantised by the lab (encoders and denoisers, real torchao kernels on this CPU)."
    pipe = tiny_pipeline(family)
    lab = copy.deepcopy(pipe)
    te = plan_text_encoders(lab, scheme, family=family, keep=(0, 0))
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
    te = plan_text_encoders(lab, 'int8wo', family=family, keep=(0, 0))
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
from diffq_lab.export import load_quantized, plan_pipeline, save_quantized
from diffq_lab.trained import load_trained_pipeline


@pytest.mark.parametrize('family,scheme', [('z-image', 'int8'), ('flux.2-klein', 'int8wo'), ('sd3', 'fp8wo'), ('qwen-image', 'int8')])
def test_a_saved_quantised_pipeline_reloads_bit_identical(family, scheme, tmp_path):
    _, lab, applied = lab_quantised(family, scheme)
    back = load_quantized(save_quantized(lab, tmp_path/'saved', applied))
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
    monkeypatch.setattr(torch, 'save', full_disk)
    with pytest.raises(OSError, match='(?i)no space left'): save_quantized(pipe, tmp_path/'x', applied)
    assert list(tmp_path.iterdir()) == []


def test_the_libraries_still_cannot_save_torchao_encoders(tmp_path):
    "Why save_quantized writes state dicts: if transformers learns to save a torchao encoder, this fails and the format can be revisited."
    _, lab, _ = lab_quantised('z-image', 'int8')
    with pytest.raises(RuntimeError, match='invalid python storage'): lab.text_encoder.save_pretrained(tmp_path)
