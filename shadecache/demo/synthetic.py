"""A small, real image classification data set made locally: no download, fully seeded.

Each sample is a `size` x `size` grey image (uint8, row-major, stored as raw bytes) of a noisy
sinusoidal grating. The class is the grating's orientation: `num_classes` orientations evenly
spread over 180 degrees, so neighbouring classes differ by 180/num_classes degrees. Spatial
frequency, phase, contrast, a jitter of the orientation, a distracting bright blob and pixel noise
vary per sample. A model has to learn oriented, phase-invariant filters to tell neighbouring
classes apart, so a small network keeps improving for several epochs, and some samples (low
contrast, strong jitter) stay hard: the per-sample losses that importance sampling feeds on differ
for real reasons.

Samples are made in the same order for the same seed, on any machine (numpy's PCG64).
"""
import numpy as np


def _images(rng, labels, size, num_classes, noise, jitter_deg, contrast_range):
    n = labels.size
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    yy = (yy - (size - 1) / 2.0)[None]
    xx = (xx - (size - 1) / 2.0)[None]
    theta = labels * (np.pi / num_classes) + np.deg2rad(rng.normal(0.0, jitter_deg, n))
    freq = rng.uniform(0.12, 0.30, n)               # cycles per pixel
    phase = rng.uniform(0.0, 2 * np.pi, n)
    contrast = rng.uniform(contrast_range[0], contrast_range[1], n)
    c, s = np.cos(theta)[:, None, None], np.sin(theta)[:, None, None]
    proj = xx * c + yy * s
    img = contrast[:, None, None] * np.sin(2 * np.pi * freq[:, None, None] * proj
                                             + phase[:, None, None])
    # one distracting blob per image, at a random place, of random sign
    by, bx = rng.uniform(0, size, n), rng.uniform(0, size, n)
    amp = rng.uniform(-0.6, 0.6, n)
    r2 = (yy + (size - 1) / 2.0 - by[:, None, None]) ** 2 + (xx + (size - 1) / 2.0
                                                           - bx[:, None, None]) ** 2
    img += amp[:, None, None] * np.exp(-r2 / (2 * (size / 6.0) ** 2))
    img += rng.normal(0.0, noise, img.shape)
    return np.clip(np.round(127.5 + 127.5 * img / 1.2), 0, 255).astype(np.uint8)


def make_images(n: int, seed: int = 0, size: int = 16, num_classes: int = 10,
                noise: float = 0.5, jitter_deg: float = 4.0, contrast_range=(0.15, 0.5)):
    """n images as a uint8 array (n, size, size) and int64 labels (n,), balanced classes."""
    if n < 1 or size < 4 or num_classes < 2:
        raise ValueError(f"make_images needs n >= 1, size >= 4, num_classes >= 2; got "
                         f"n={n}, size={size}, num_classes={num_classes}")
    rng = np.random.default_rng([seed, 0x5EED])
    labels = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
    imgs = np.empty((n, size, size), dtype=np.uint8)
    step = 4096   # bounded memory for large n
    for a in range(0, n, step):
        imgs[a:a + step] = _images(rng, labels[a:a + step], size, num_classes, noise, jitter_deg,
                                     contrast_range)
    return imgs, labels


class SyntheticImages:
    """A map-style data set of (bytes, label), as `shadecache.pack` takes it."""

    def __init__(self, n: int, seed: int = 0, size: int = 16, num_classes: int = 10, **kw):
        self.images, self.labels = make_images(n, seed, size, num_classes, **kw)
        self.size = size
        self.num_classes = num_classes

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i].tobytes(), int(self.labels[i])


def decode(data, size: int = 16) -> np.ndarray:
    """bytes of one stored sample -> float32 image (size*size,) scaled to about [-1, 1]."""
    a = np.frombuffer(data, dtype=np.uint8)
    if a.size != size * size:
        raise ValueError(f"sample has {a.size} bytes, a {size}x{size} image needs {size * size}")
    return (a.astype(np.float32) - 127.5) / 127.5
