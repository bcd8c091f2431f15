"""Sources of randomness for the privacy-relevant draws: Poisson sampling and Gaussian noise.

Opacus's two modes (``PrivacyEngine(secure_mode=...)``): **reproducible**, every draw from
generators seeded by one integer (every bit used: numpy's PCG64 and a full Mersenne-Twister state
through ``SeedSequence``; without a seed the engine follows torch's RNG, drawing its seed from it
at the first draw), and **secure**, where a seed is refused, the sampler's uniforms come from
``os.urandom`` and the noise is drawn as Opacus does in secure mode (robust to Mironov 2012's and
Haney et al. 2022's floating-point attacks).  The seed is as secret as the data: never printed or
written publicly.  :class:`RunSeeds` holds a run's seeds and builds its sources.  The modes in
full: docs/guarantees.md.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from ...validation import InvalidParameterError


def resolve_seed(seed, secure_mode: bool) -> int | None:
    """The seed a run uses: the given one, a fresh recorded one, or None in secure mode."""
    if secure_mode:
        if seed is not None:
            raise InvalidParameterError(
                "seed",
                seed,
                "must not be given in secure mode (secure_mode=True draws "
                "every privacy-relevant random number from OS entropy; a seed would "
                "make the sampling and the noise predictable)",
            )
        return None
    if seed is None:
        return secrets.randbits(63)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or int(seed) < 0:
        raise InvalidParameterError("seed", seed, "must be an integer >= 0 (or None for a fresh recorded seed)")
    return int(seed)


def derive_seed(seed: int, *path: int) -> int:
    """A seed for one part of a larger job (one model of an audit, one repetition of an experiment),
    derived from the job's ``seed`` and the part's ``path`` through numpy's ``SeedSequence`` (< 2^63;
    distinct paths give independent streams)."""
    state = np.random.SeedSequence([int(seed), *map(int, path)]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


def randomness_note(secure_mode: bool, where: str | None) -> str:
    """What a public report says about a run's randomness instead of its seed: secure mode, or where
    the seed is recorded privately (``where``, e.g. ``private/seed.json``), with the warning that a
    model meant for release must be trained in secure mode."""
    if secure_mode:
        return (
            "secure mode: the Poisson sampling and the noise come from OS entropy (no seed exists; "
            "the run cannot be replayed)"
        )
    return (
        f"not secure mode: the sampling, the noise and the initialisation come from one seed, recorded "
        f"privately in {where or 'the private part of the result'} (never publish it: with the seed and every "
        "record but one, anyone can replay the run and compare, which voids the guarantee); the generators "
        "are not cryptographic, so a model meant for release must be trained in secure mode"
    )


SECURE_RNG_WARNING = (
    "Secure RNG turned off. This is perfectly fine for experimentation as it allows for much faster "
    "training performance, but remember to turn it on and retrain one last time before production "
    "with ``secure_mode`` turned on."
)


#: Byte layout of a CPU ``torch.Generator``'s state (ATen's ``CPUGeneratorImplState``): the initial
#: seed (uint64), ``left`` and ``seeded`` (int32), ``next`` (uint64), then the 624 Mersenne-Twister
#: words (one uint64 each), then the cached normal samples.
_MT_WORDS, _MT_OFFSET = 624, 24


def _mt_words(state: np.ndarray) -> np.ndarray:
    return state[_MT_OFFSET : _MT_OFFSET + 8 * _MT_WORDS].view(np.uint64)


def _full_state_cpu_generator(seed: int) -> torch.Generator:
    """A CPU generator whose whole Mersenne-Twister state comes from ``SeedSequence(seed)`` (as numpy's
    ``MT19937(seed)``): every bit of ``seed`` changes the stream.  The state layout is checked against
    ``manual_seed``'s documented initialisation first; an unknown layout is an error, never a silent
    32-bit seed."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(1)
    state = gen.get_state().numpy().copy()
    words = _mt_words(state)
    head = np.frombuffer(
        state[:_MT_OFFSET].tobytes(),
        dtype=np.dtype([("seed", "=u8"), ("left", "=i4"), ("seeded", "=i4"), ("next", "=u8")]),
    )[0]
    expect_1 = (1812433253 * (1 ^ (1 >> 30)) + 1) & 0xFFFFFFFF
    if (
        state.size < _MT_OFFSET + 8 * _MT_WORDS
        or words[0] != 1
        or words[1] != expect_1
        or head["left"] != 1
        or head["seeded"] != 1
        or head["next"] != 0
    ):
        raise RuntimeError(
            f"torch {torch.__version__}: unknown CPU generator state layout; cannot seed the noise "
            "generator with every bit of the seed (use secure_mode=True, or report this)"
        )
    fresh = np.random.SeedSequence(int(seed)).generate_state(_MT_WORDS, dtype=np.uint32).astype(np.uint64)
    fresh[0] = 0x80000000  # as numpy's MT19937: the state is never all zeros
    words[:] = fresh
    state[:8] = np.frombuffer(np.uint64(int(seed) % 2**64).tobytes(), dtype=np.uint8)  # initial_seed()
    gen.set_state(torch.from_numpy(state))  # left = 1, next = 0: the first draw twists the new state
    return gen


def seeded_generator(device, seed: int) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` whose stream depends on every bit of ``seed`` (< 2^64): on CPU
    the whole Mersenne-Twister state from ``SeedSequence`` (:func:`_full_state_cpu_generator`), on
    CUDA ``manual_seed`` (Philox takes the 64-bit seed whole)."""
    device = torch.device(device)
    if device.type == "cpu":
        return _full_state_cpu_generator(seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


class SecureUniform:
    """Uniform [0, 1) doubles from ``os.urandom`` (the OS CSPRNG): 53 random bits each."""

    def random(self, size: int) -> np.ndarray:
        raw = np.frombuffer(secrets.token_bytes(8 * int(size)), dtype=np.uint64)
        return (raw >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


#: ``initial_seed()`` of a torch generator that was never seeded: torch's public default stream, which
#: anyone can replay, so the engine never takes its randomness from it.
UNSEEDED = torch.Generator().initial_seed()


def seed_from_torch(generator: torch.Generator | None = None) -> int:
    """One 63-bit seed drawn from a torch generator (None: torch's global generator), or from OS
    entropy when that generator was never seeded (its stream would be torch's public default)."""
    g = torch.default_generator if generator is None else generator
    if g.initial_seed() == UNSEEDED:
        return secrets.randbits(63)
    return int(torch.randint(0, 2**63 - 1, (1,), generator=g, device=g.device, dtype=torch.int64))


class Deferred:
    """A source of randomness built at its first use by ``make()`` (the engine draws its seed then)."""

    def __init__(self, make):
        self._make, self._built = make, None

    def resolve(self):
        if self._built is None:
            self._built = self._make()
        return self._built


class DeferredUniform(Deferred):
    """The Poisson sampler's uniforms (``random(size)``), its generator built at the first draw."""

    def random(self, size: int) -> np.ndarray:
        return self.resolve().random(size)

    @property
    def bit_generator(self):
        return self.resolve().bit_generator


class DeferredGenerator(Deferred):
    """The noise's ``torch.Generator`` on ``device``, built at the first noise draw."""

    def __init__(self, make, device):
        super().__init__(make)
        self.device = torch.device(device)

    def get_state(self) -> torch.Tensor:
        return self.resolve().get_state()

    def set_state(self, state) -> None:
        self.resolve().set_state(state)


def sampler_rng(seed: int | None, secure_mode: bool):
    """The Poisson sampler's source of uniforms (anything with ``random(size)``)."""
    return SecureUniform() if secure_mode else np.random.default_rng(seed)


class OsEntropyNormal:
    """Gaussian noise from ``os.urandom`` (the OS CSPRNG), for secure mode without ``torchcsprng``.

    PyTorch's own generators are not cryptographic (and a CPU generator keeps only 32 bits of its
    seed), so secure mode never uses them for noise.  Normals come from Box–Muller on 53-bit
    uniforms read from ``os.urandom``, in float64; :func:`gaussian_like` then applies Opacus's
    defence against floating-point attacks (the sum of four draws, halved).
    """

    def normal(self, shape) -> torch.Tensor:
        n = int(np.prod(shape)) if len(shape) else 1
        m = (n + 1) // 2
        u = SecureUniform().random(2 * m).reshape(2, m)
        r = np.sqrt(-2.0 * np.log1p(-u[0]))  # 1 - u in (0, 1]: log is finite
        z = np.concatenate([r * np.cos(2 * np.pi * u[1]), r * np.sin(2 * np.pi * u[1])])[:n]
        return torch.from_numpy(z).reshape(tuple(shape))


def noise_generator(device, seed: int | None, secure_mode: bool):
    """The source of the Gaussian noise on ``device``: a ``torch.Generator`` seeded with every bit of
    ``seed`` (:func:`seeded_generator`); in secure mode
    ``torchcsprng``'s ``/dev/urandom`` generator when installed (as Opacus), else
    :class:`OsEntropyNormal` — never a seeded PyTorch generator."""
    device = torch.device(device)
    if secure_mode:
        try:
            import torchcsprng as csprng

            return csprng.create_random_device_generator("/dev/urandom")
        except ImportError:
            return OsEntropyNormal()
    return seeded_generator(device, int(seed))


class RunSeeds:
    """The run's seeds, in one object: the noise's (``seed``) and the Poisson sampler's
    (``sampler_seed``), how they are chosen (given, followed from torch, or none in secure mode),
    and the sources built from them.  The engine holds one; distributed set-up returns the one
    every rank uses (:meth:`with_values`) instead of writing the engine's."""

    def __init__(self, seed: int | None, secure_mode: bool):
        self.secure_mode = bool(secure_mode)
        self.follow_torch = seed is None and not self.secure_mode  # drawn from torch at the first draw
        self.given = seed is not None  # a drawn seed yields to a checkpoint's on load
        self.seed = None if self.follow_torch else resolve_seed(seed, self.secure_mode)
        self.sampler_seed = self.seed  # the Poisson sampler's (the loader generator's when followed)
        self.loader_generator = None  # the data loader's generator, followed by the sampler

    def with_values(self, seed: int | None, sampler_seed: int | None) -> RunSeeds:
        """A copy holding these seeds (rank 0's, broadcast), chosen the same way."""
        out = RunSeeds.__new__(RunSeeds)
        out.__dict__.update(self.__dict__)
        out.seed, out.sampler_seed = seed, sampler_seed
        return out

    def following(self, loader_generator) -> RunSeeds:
        """A copy whose sampler follows the data loader's ``generator`` (when the seeds follow torch)."""
        out = self.with_values(self.seed, self.sampler_seed)
        if out.follow_torch:
            out.loader_generator = loader_generator
        return out

    def resume(self, seed: int) -> None:
        """Continue with a checkpoint's noise seed (this run's own was drawn, not given)."""
        self.seed = int(seed)

    def resume_sampler(self, sampler_seed: int | None) -> None:
        """Continue with a checkpoint's sampler seed (this run's own was drawn, not given)."""
        self.sampler_seed = sampler_seed

    def draw(self) -> int | None:
        """The noise's seed; without one given (non-secure), drawn now from torch's global generator."""
        if self.seed is None and self.follow_torch:
            self.seed = seed_from_torch(None)
        return self.seed

    def draw_sampler(self) -> int | None:
        """The Poisson sampler's seed: the engine's, or drawn now from the data loader's generator."""
        if self.sampler_seed is None and self.follow_torch:
            self.sampler_seed = (
                seed_from_torch(self.loader_generator) if self.loader_generator is not None else self.draw()
            )
        return self.sampler_seed

    def sampler_rng(self):
        """The Poisson sampler's source; built at its first draw when the seed follows torch."""
        if self.follow_torch and self.sampler_seed is None:
            return DeferredUniform(lambda: sampler_rng(self.draw_sampler(), False))
        return sampler_rng(self.sampler_seed, self.secure_mode)

    def noise_generator(self, device):
        """The noise's source on ``device``; built at its first draw when the seed follows torch."""
        if self.follow_torch and self.seed is None:
            return DeferredGenerator(lambda: noise_generator(device, self.draw(), False), device)
        return noise_generator(device, self.seed, self.secure_mode)


def gaussian_like(std: float, reference: torch.Tensor, generator, secure_mode: bool) -> torch.Tensor:
    """N(0, std²) noise shaped like ``reference`` on its device and dtype: Opacus's
    ``_generate_noise`` with a torch generator, or OS-entropy normals (four draws summed and
    halved, Opacus's secure-mode construction) with :class:`OsEntropyNormal`."""
    if isinstance(generator, Deferred):
        generator = generator.resolve()
    if isinstance(generator, OsEntropyNormal):
        if std == 0:
            return torch.zeros_like(reference)
        z = sum(generator.normal(reference.shape) for _ in range(4)) / 2
        return (std * z).to(device=reference.device, dtype=reference.dtype)
    if not secure_mode and std != 0 and type(reference) is torch.Tensor:
        # exactly the draw of Opacus's _generate_noise outside secure mode, without the parameter-sized tensor of
        # zeros it allocates first and then leaves unused
        return torch.normal(
            mean=0, std=std, size=reference.shape, device=reference.device, generator=generator, dtype=reference.dtype
        )
    from opacus.optimizers.optimizer import _generate_noise

    return _generate_noise(std=std, reference=reference, generator=generator, secure_mode=secure_mode)
