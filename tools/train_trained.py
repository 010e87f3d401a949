"""Retrain the lab's trained pipeline (data/trained) with its recipe, checkpointing the DiT's EMA weights as it goes.

    .venv/bin/python tools/train_trained.py [--reuse-vae] [--steps N] [--checkpoints DIR]

--reuse-vae keeps the committed autoencoder (stage 1 of the previous training: same config, data and steps) and
trains only the DiT. A checkpoint (step, EMA state dict, loss curve) is written to DIR/dit.pt every 100 steps, so a run
cut short still leaves its latest EMA weights; the finished run is saved by `save_trained` into data/trained with
its digests (data/trained.sha256.json).
"""
import argparse, os, sys, time
from pathlib import Path
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--reuse-vae', action='store_true', help="keep data/trained's autoencoder (stage 1 skipped)")
    ap.add_argument('--steps', type=int, default=None, help='DiT steps (default: the TrainRecipe default)')
    ap.add_argument('--checkpoints', default='/tmp/diffq_lab_train', help='where dit.pt is written every 100 steps')
    ap.add_argument('--threads', type=int, default=1, help='torch threads (1: fastest on a shared 2-core CPU)')
    a = ap.parse_args(argv)
    from diffq_lab.lab_trained import TrainRecipe, train_all
    from diffq_lab.trained import trained_dir
    ck = Path(a.checkpoints); ck.mkdir(parents=True, exist_ok=True)
    def checkpoint(step, ema, curve, seconds):
        if step % 100 == 0:
            torch.save(dict(step=step, ema=ema.state_dict(), curve=curve, seconds=seconds), ck/'dit.pt.tmp')
            os.replace(ck/'dit.pt.tmp', ck/'dit.pt')
    over = {} if a.steps is None else dict(dit_steps=a.steps)
    t0 = time.time()
    _, log = train_all(TrainRecipe.of(**over), threads=a.threads, callback=checkpoint,
                       vae=trained_dir() if a.reuse_vae else None, log=lambda s: print(s, flush=True))
    print(f"saved {trained_dir()} after {time.time() - t0:.0f} s ({log['cpu_seconds']:.0f} CPU s)", flush=True)


if __name__ == '__main__':
    sys.exit(main())
