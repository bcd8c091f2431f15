"""Sources of randomness for the privacy-relevant draws: Poisson sampling and Gaussian noise.

Two modes, with Opacus's semantics (``PrivacyEngine(secure_mode=...)``):

* **reproducible** (default) — every draw comes from generators seeded by one integer seed.  A
  given seed replays a run exactly; without a seed a fresh one is drawn from OS entropy and
  *recorded* (``engine.seed``, and the report), so the run can be replayed.
* **secure** — a seed is refused (privacy beats replay).  Poisson sampling draws its uniforms
  straight from the operating system's CSPRNG (``os.urandom``); the noise generator is seeded
  from OS entropy and re-seeded from it before every step, and the noise itself is drawn as
  Opacus does in secure mode (the sum of four normals halved, after a discarded draw: robust to
  the floating-point attacks of Mironov 2012 / Haney et al. 2022, see
  ``opacus.optimizers.optimizer._generate_noise``).  PyTorch has no cryptographic normal
  sampler; when ``torchcsprng`` is installed its ``/dev/urandom`` generator is used instead,
  exactly as Opacus does.  Nothing about a secure run's randomness is written anywhere.
"""
from __future__ import annotations

import secrets

import numpy as np
import torch

from ..validation import InvalidParameterError


def resolve_seed(seed, secure_mode: bool) -> int | None:
    """The seed a run uses: the given one, a fresh recorded one, or None in secure mode."""
    if secure_mode:
        if seed is not None:
            raise InvalidParameterError("seed", seed, "must not be given in secure mode (secure_mode=True draws "
                                        "every privacy-relevant random number from OS entropy; a seed would "
                                        "make the sampling and the noise predictable)")
        return None
    if seed is None:
        return secrets.randbits(63)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or int(seed) < 0:
        raise InvalidParameterError("seed", seed, "must be an integer >= 0 (or None for a fresh recorded seed)")
    return int(seed)


class SecureUniform:
    """Uniform [0, 1) doubles from ``os.urandom`` (the OS CSPRNG): 53 random bits each."""

    def random(self, size: int) -> np.ndarray:
        raw = np.frombuffer(secrets.token_bytes(8 * int(size)), dtype=np.uint64)
        return (raw >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def sampler_rng(seed: int | None, secure_mode: bool):
    """The Poisson sampler's source of uniforms (anything with ``random(size)``)."""
    return SecureUniform() if secure_mode else np.random.default_rng(seed)


def noise_generator(device, seed: int | None, secure_mode: bool):
    """A torch generator on ``device`` for the Gaussian noise."""
    device = torch.device(device)
    if secure_mode:
        try:
            import torchcsprng as csprng  # noqa: PLC0415  (optional, as in Opacus)
            return csprng.create_random_device_generator("/dev/urandom")
        except ImportError:
            gen = torch.Generator(device=device)
            gen.manual_seed(secrets.randbits(64))
            return gen
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


def reseed_secure(generator) -> None:
    """Re-seed a (non-csprng) secure-mode noise generator from OS entropy before a step."""
    if isinstance(generator, torch.Generator):
        generator.manual_seed(secrets.randbits(64))
