"""A new scheme is its registry entry and its recipe: registered here, it appears in the probe, the ladder, the numerics,
the study and the roofline with no other edit."""
import dataclasses, os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
from diffq_lab.schemes import REGISTRY, SCHEMES, get_scheme, register_scheme, unregister_scheme
from diffq_lab.emulate import EMULATIONS, get_emulation, register_emulation

NAME = 'int8_twin'


@pytest.fixture(scope='module')
def twin():
    "int8's facts under a new name, one rung after int8 in the ladder, timed by the roofline as int8."
    s = register_scheme(dataclasses.replace(get_scheme('int8'), name=NAME, aliases=('w8a8_twin',), auto_rank=3,
                                            consumer_rank=None, doc='a throwaway copy of int8'))
    e = get_emulation('int8')
    recipe = {f.name: getattr(e, f.name) for f in dataclasses.fields(e) if f.name not in ('scheme', 'forward')}
    register_emulation(NAME, **recipe)(e.forward)
    yield s
    EMULATIONS.pop(NAME, None)
    unregister_scheme(NAME)


def test_registered_everywhere_the_registry_is_read(twin):
    from diffq_lab.schemes import normalize_scheme
    assert NAME in SCHEMES and SCHEMES[-1] == NAME and normalize_scheme('W8A8-twin') == NAME


def test_the_probe_reports_it(twin):
    from diffq_lab.capability import capability_report
    row = capability_report('cpu').set_index('scheme').loc[NAME]
    assert row.gate_ok and row.probe_ok and row.runs_as != 'nothing'


def test_the_ladder_takes_it_by_its_rank(twin):
    from diffq_lab.capability import auto_ladder
    from diffq_lab.text_encoder import encoder_ladder
    assert auto_ladder((9, 0), False) == ('fp8', 'int8', NAME)
    assert auto_ladder((8, 9), True) == ('int8', 'fp8', NAME)  # int8 leads on consumer parts; the twin keeps its rank
    assert NAME in encoder_ladder((9, 0))                      # encoder_auto came with int8's record


def test_the_numerics_and_the_study_run_it(twin):
    from diffq_lab.study import STUDY_PROMPTS, run_study, scheme_numerics
    num = scheme_numerics([NAME, 'int8'], device='cpu', backend='emulate').set_index(['scheme', 'tokens'])
    assert num.loc[(NAME, 'outliers'), 'cosine'] == pytest.approx(num.loc[('int8', 'outliers'), 'cosine'], abs=1e-6)
    st = run_study(schemes=[NAME], seeds=(0,), prompts=STUDY_PROMPTS[:1], device='cpu', progress=False, control=False)
    row = st.set_index('requested').loc[NAME]
    assert row.status == 'ok' and row.transformer_scheme == NAME and row.te_scheme == NAME and row.psnr > 10


def test_the_roofline_times_it_as_its_format(twin):
    from diffq_lab.crossover import roofline
    a, b = (roofline('h100', (4096, 3072, 12288), s) for s in (NAME, 'int8'))
    assert a['scheme'] == NAME and a['time_s'] == b['time_s']
    with pytest.raises(ValueError, match='roofline models'): roofline('h100', (64, 64, 64), 'int8wo')


def test_unregistering_takes_every_spelling_away():
    from diffq_lab.schemes import normalize_scheme
    register_scheme(dataclasses.replace(get_scheme('fp8wo'), name='fp8wo_twin', aliases=('w8a16_twin',)))
    unregister_scheme('w8a16_twin')
    assert 'fp8wo_twin' not in REGISTRY and 'fp8wo_twin' not in SCHEMES
    with pytest.raises(ValueError, match='unknown scheme'): normalize_scheme('w8a16_twin')
