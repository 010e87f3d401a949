"Integration, property and bad-input tests of diffq_lab.trained: the procedural data, the committed weights, the adherence checker."
import json, os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from diffq_lab.core import load_table
from diffq_lab.trained import (COLOURS, POSITIONS, SHAPES, SIZES, adherence, analyse, caption, draw_scene, evaluate, heldout_prompts,
                               is_held_out, load_trained_pipeline, make_dataset, parse_prompt, render_trained, scene_params,
                               record_trained, trained_dir)

@pytest.fixture(scope='module')
def pipe(): return load_trained_pipeline()

# --- the dataset -------------------------------------------------------------------------------

def test_dataset_is_complete_deterministic_and_split():
    ps = scene_params()
    assert len(ps) == len(set(ps)) == len(SHAPES)*len(COLOURS)*len(SIZES)*len(POSITIONS)
    a, b = make_dataset('all'), make_dataset('all')
    assert torch.equal(a['images'], b['images']) and a['captions'] == b['captions']
    assert a['images'].min() >= 0 and a['images'].max() <= 1
    assert len(set(a['captions'])) == len(ps)  # captions identify scenes
    ho = [p for p in ps if is_held_out(p)]
    assert 0.05 < len(ho)/len(ps) < 0.15 and heldout_prompts() == [caption(*p) for p in ho]

def test_every_caption_parses_back():
    for p in scene_params(): assert parse_prompt(caption(*p)) == p

@pytest.mark.parametrize('bad', [('hexagon', 'red', 'small', 'top'), ('circle', 'pink', 'small', 'top'),
                                 ('circle', 'red', 'huge', 'top'), ('circle', 'red', 'small', 'upstairs')])
def test_bad_scene_names_the_choices(bad):
    with pytest.raises(ValueError, match='choose one of'): draw_scene(*bad)

def test_bad_split_and_prompt():
    with pytest.raises(ValueError, match='heldout'): make_dataset('validation')
    with pytest.raises(ValueError, match='procedural caption'): parse_prompt('a photo of a cat')

# --- the checker -------------------------------------------------------------------------------

def test_checker_scores_one_on_ground_truth():
    d = make_dataset('all')
    for im, c, p in zip(d['images'], d['captions'], d['params']):
        assert adherence(im, c) == 1.0
        a = analyse(im)
        assert (a['shape'], a['colour'], a['size'], a['position']) == p

def test_checker_penalises_each_wrong_attribute():
    p = ('circle', 'red', 'large', 'centre')
    assert adherence(draw_scene('square', 'red', 'large', 'centre'), caption(*p)) == pytest.approx(2/3)
    assert adherence(draw_scene('circle', 'blue', 'large', 'centre'), caption(*p)) == pytest.approx(2/3)
    assert adherence(draw_scene('circle', 'red', 'large', 'top left'), caption(*p)) == pytest.approx(2/3)
    assert adherence(draw_scene('triangle', 'green', 'small', 'bottom right'), caption(*p)) == 0
    assert adherence(torch.zeros(3, 32, 32), caption(*p)) == 0
    assert adherence(draw_scene(*p)[None], p) == 1  # a batch of one and a params tuple are accepted

def test_checker_is_resolution_independent():
    for p in scene_params()[::7]: assert adherence(draw_scene(*p, res=64), caption(*p)) == 1.0

def test_checker_rejects_bad_images():
    with pytest.raises(ValueError, match=r'\(3, H, W\)'): analyse(torch.zeros(1, 32, 32))
    with pytest.raises(ValueError, match=r'\(3, H, W\)'): analyse(torch.zeros(2, 3, 32, 32))

# --- the committed weights ---------------------------------------------------------------------

def test_committed_weights_are_small_safetensors():
    d = trained_dir()
    files = sorted(f.name for f in d.iterdir())
    assert {'model_index.json', 'training.json', 'transformer', 'vae', 'text_encoder', 'tokenizer', 'scheduler'} <= set(files)
    assert all(p.suffix != '.bin' for p in d.rglob('*'))  # safetensors only: nothing pickled is committed
    assert sum(f.stat().st_size for f in d.rglob('*') if f.is_file()) < 40e6
    log = json.loads((d/'training.json').read_text())
    assert log['dit_curve'][-1] < log['dit_curve'][0] and log['vae_curve'][-1] < log['vae_curve'][0]


def test_data_trained_is_a_standard_diffusers_folder():
    "DiffusionPipeline.from_pretrained opens it offline, and renders what the lab's loader renders."
    from diffusers import DiffusionPipeline
    from diffq_lab.pipelines import cast_as_loaded
    pipe = DiffusionPipeline.from_pretrained(trained_dir(), local_files_only=True)
    assert type(pipe).__name__ == 'ZImagePipeline'
    for comp in (pipe.transformer, pipe.vae, pipe.text_encoder): cast_as_loaded(comp.eval(), torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    lab = load_trained_pipeline()
    prompt = heldout_prompts()[0]
    assert torch.equal(render_trained(pipe, prompt), render_trained(lab, prompt))

def test_loads_with_wide_linears_and_renders_deterministically(pipe):
    lin = [m for m in pipe.transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(min(m.in_features, m.out_features) >= 512 for m in lin) >= 8  # attention + MLP pass the 512-feature filter
    assert pipe.transformer.dtype == torch.bfloat16 and pipe._diffq_family == 'z-image'
    p = heldout_prompts()[3]
    a, b, c = render_trained(pipe, p, seed=1), render_trained(pipe, p, seed=1), render_trained(pipe, p, seed=2)
    assert a.shape == (3, 32, 32) and torch.equal(a, b) and not torch.equal(a, c)
    assert 0 <= float(a.min()) and float(a.max()) <= 1

def test_loader_in_fp32_matches_dtype():
    p = load_trained_pipeline(torch.float32)
    assert p.transformer.dtype == torch.float32 and p.vae.dtype == torch.float32

def test_loader_says_how_to_rebuild(tmp_path):
    with pytest.raises(FileNotFoundError, match='train_all'): load_trained_pipeline(root=tmp_path)

def test_dense_model_draws_something_adherent(pipe):
    df = evaluate(pipe, make_dataset('train')['captions'][::40], seeds=(0,))
    assert len(df) == 7 and df.adherence.between(0, 1).all()
    assert df.adherence.mean() > 1/3  # better than a single-attribute guess on training prompts

def test_record_trained_writes_to_the_given_root(tmp_path, monkeypatch):
    import diffq_lab.trained as T
    monkeypatch.setattr(T, 'heldout_prompts', lambda: heldout_prompts()[:2])
    monkeypatch.setattr(T, 'make_dataset', lambda split='train': dict(captions=make_dataset(split)['captions'][:9]))
    t = record_trained(root=tmp_path, seeds=(0,))
    assert list(t.split) == ['heldout', 'train'] and t.adherence.between(0, 1).all()
    assert len(load_table('trained_adherence', root=tmp_path)) == 2  # written under tmp_path, not the repo
    assert set(t.columns) >= {'adherence', 'ci_low', 'ci_high', 'colour', 'shape', 'position', 'run'}
