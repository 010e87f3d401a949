__version__ = "0.1.0"
# Hand-written (nbdev_export only keeps the `__version__` line above up to date): not exported from a notebook.

# Quiet imports. torchao, torch and diffusers log a few known, harmless messages the first time the lab
# imports them (lazily, on the first quantisation). Each filter below drops ONE of those messages, on the
# logger that emits it, and nothing else: every other record of those loggers, and every warning of the
# lab's own, still shows. The lab's modules import torchao late, so the filters are installed here, before.
# A message logged before the lab is imported (torchao's, when `import diffusers` comes first and loads it) is
# past filtering: import the lab first, as the README's snippets do.
import logging as _logging, re as _re

class _KnownNoise(_logging.Filter):
    "Drop the records of one logger whose message matches `pattern` (and, if given, `when(record)`)."
    def __init__(self, pattern: str, when=None):
        super().__init__(); self.pattern, self.when = _re.compile(pattern), when
    def filter(self, record):
        try: noise = bool(self.pattern.search(record.getMessage())) and (self.when is None or self.when(record))
        except Exception: noise = False  # a filter must never hide a record by failing
        return not noise

def _no_cuda(record) -> bool:
    import torch  # already imported by whoever logs this
    return not torch.cuda.is_available()

def _torchao_enum(record) -> bool:
    cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return getattr(cls, '__module__', '').startswith('torchao')

_QUIET = {
    # torchao >= 0.17 loads its CUDA kernel libraries at import; without CUDA they cannot load (kept on a GPU box).
    'torchao': _KnownNoise(r"^Failed to load \S*torchao/_C_(mxfp8|cutlass_90a)[\w.-]*\.so: ", _no_cuda),
    # torch 2.13 deprecates register_constant() on Enums, which torchao still calls on its own Enums.
    'torch.utils._pytree': _KnownNoise(r"^<enum '\w+'> is an Enum subclass and is now natively supported by "
                                       r"torch\.compile as an opaque value type\. Calling register_constant\(\) on "
                                       r"Enum subclasses is deprecated", _torchao_enum),
    # diffusers 0.42 looks for torchao tensor classes that newer torchao removed; the lab never loads such checkpoints.
    'diffusers.quantizers.torchao.torchao_quantizer': _KnownNoise(
        r"^Unable to import `torchao` Tensor objects\. This may affect loading checkpoints serialized with `torchao`$"),
    # transformers 5 names the torchvision image processors; without torchvision (it does not import beside the CPU
    # torch) it falls back to the PIL ones, which the pipelines' CLIP / Siglip image processors then are: same output.
    'transformers.utils.import_utils': _KnownNoise(
        r"^`\w+ImageProcessor` requires torchvision \(not installed\); falling back to `\w+ImageProcessorPil` "),
}
for _name, _filter in _QUIET.items():
    _logger = _logging.getLogger(_name)
    if not any(isinstance(f, _KnownNoise) for f in _logger.filters): _logger.addFilter(_filter)
del _name, _filter, _logger
