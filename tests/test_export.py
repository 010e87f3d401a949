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
from diffq_lab.plan import QuantPlan, apply_plan, export_snippet, to_pipeline_config
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
    rt = DiffusionPipeline.from_pretrained(tmp_path, quantization_config=to_pipeline_config(applied), torch_dtype=torch.bfloat16)
    same(rt, lab, applied)


def test_the_snippet_runs_as_written(tmp_path):
    pipe, lab, applied = lab_quantised('flux.2-klein', 'int8')
    pipe.save_pretrained(tmp_path)
    scope = {}
    exec(export_snippet(applied, str(tmp_path)), scope)
    same(scope['pipe'], lab, applied)


def test_what_diffusers_cannot_express_is_refused():
    "flux.1's top-level proj_out stays dense under fp8wo (not divisible by 16), but diffusers matches 'proj_out.' anywhere: refused."
    _, _, applied = lab_quantised('flux.1-dev', 'fp8wo')
    with pytest.raises(ValueError, match=re.escape("would also keep ['single_transformer_blocks.0.proj_out'] dense")):
        to_pipeline_config(applied)
