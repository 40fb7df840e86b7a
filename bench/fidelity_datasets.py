"""The data sets of bench/fidelity.py: five classification tasks of different kinds, made here.

Nothing is downloaded: scikit-learn's generators and numpy make every sample, seeded, so the same
data set comes back on any machine. Every test set is large enough that its sampling noise (the
standard error of an accuracy measured on it, sqrt(p (1 - p) / n)) is at most 0.15 points at the
accuracy the task reaches; `TEST_NOISE_POINTS` is the target and `test_noise()` the figure.

  tabular     sklearn make_classification: 32 features, 10 classes, 3% flipped labels; an MLP
  gratings-s  16x16 grey gratings (shadecache.demo.synthetic, data seed 1), no augmentation: the
              MLP memorizes its 3,000 training images
  sequence    token sequences (vocabulary 64, length 32): a class is told by which class's motifs
              (trigrams) occur, among decoy trigrams, corrupted tokens and flipped labels; an
              embedding, a 1-D convolution and a max over time (a text task)
  shapes      16x16 colour images of ten shapes at random places, sizes and colours, on a
              coloured gradient with a distracting blob and noise; a small conv net
  longtail    Gaussian clusters in 24 dimensions whose class frequencies fall by 0.65 per class
              (the largest class 36 times the smallest), 2% flipped labels; an MLP

The defaults of ShadeSampler were tuned, before these measurements, on scikit-learn's digits (its
600 test images carry 0.5 points of sampling noise, so it is no longer used); tabular and
gratings-s were measured with those defaults fixed; sequence, shapes and longtail were made for
this benchmark and no setting was chosen on them (`TUNED_ON`).
"""
import numpy as np

TEST_NOISE_POINTS = 0.15
# what an earlier setting was chosen by looking at (see the module docstring)
TUNED_ON = {"tabular": "measured with the defaults fixed", "gratings-s": "measured with the "
            "defaults fixed", "sequence": "none", "shapes": "none", "longtail": "none"}


def _spec(train, test, shape, dtype, model, kind, batch=64):
    return dict(train=train, test=test, shape=shape, dtype=np.dtype(dtype), model=model,
                kind=kind, batch=batch)


def tabular(test_n=100_000):
    from sklearn.datasets import make_classification
    x, y = make_classification(n_samples=3000 + test_n, n_features=32, n_informative=16,
                               n_redundant=4, n_classes=10, n_clusters_per_class=2, flip_y=0.03,
                               class_sep=1.2, random_state=0)
    x = ((x - x[:3000].mean(0)) / x[:3000].std(0)).astype(np.float32)
    return _spec((x[:3000], y[:3000]), (x[3000:], y[3000:]), (32,), np.float32, "mlp",
                 "tabular")


def gratings_s(test_n=120_000):
    from shadecache.demo import synthetic
    x, y = synthetic.make_images(3000, seed=1)
    tx, ty = synthetic.make_images(test_n, seed=1 + 10_000)
    return _spec((x.reshape(3000, -1), y), (tx.reshape(test_n, -1), ty), (256,), np.uint8, "mlp",
                 "image, memorized")


def _motif_sequences(rng, labels, motifs, decoys, vocab, length, corrupt, flip):
    """Sequences of `length` tokens: Zipf-like background, two motifs (trigrams) of the sample's
    class and two decoy trigrams (of no class) at random places, each of their tokens replaced at
    random with probability `corrupt`; then a fraction `flip` of the labels is replaced by a
    random class."""
    n, k = labels.size, motifs.shape[0]
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = (1.0 / ranks) / (1.0 / ranks).sum()
    seq = rng.choice(vocab, size=(n, length), p=p).astype(np.uint8)
    m = motifs.shape[2]
    inserts = [motifs[labels, rng.integers(0, motifs.shape[1], n)] for _ in range(2)]
    inserts += [decoys[rng.integers(0, len(decoys), n)] for _ in range(2)]
    rng.shuffle(inserts)
    for tokens in inserts:
        noise = rng.random((n, m)) < corrupt
        tokens = np.where(noise, rng.integers(0, vocab, (n, m)), tokens)
        at = rng.integers(0, length - m + 1, n)
        seq[np.arange(n)[:, None], at[:, None] + np.arange(m)] = tokens
    y = labels.copy()
    flipped = rng.random(n) < flip
    y[flipped] = rng.integers(0, k, int(flipped.sum()))
    return seq, y


def sequence(test_n=90_000, n=3000):
    rng = np.random.default_rng([22, 1])
    vocab, length, k = 64, 32, 10
    motifs = rng.integers(0, vocab, (k, 3, 3))
    decoys = rng.integers(0, vocab, (16, 3))
    labels = rng.permutation(np.arange(n + test_n) % k)
    x, y = _motif_sequences(rng, labels, motifs, decoys, vocab, length, corrupt=0.2, flip=0.02)
    return _spec((x[:n], y[:n]), (x[n:], y[n:]), (length,), np.uint8, "seq", "sequence (text)")


def _shape_masks(kind, yy, xx, r):
    """Boolean masks (n, S, S) of shape `kind` (0..9) with centre-relative coordinates yy, xx and
    radius r (n, 1, 1)."""
    ay, ax = np.abs(yy), np.abs(xx)
    t = 0.35 * r
    return [
        yy ** 2 + xx ** 2 <= r ** 2,                                    # disk
        (ay <= 0.8 * r) & (ax <= 0.8 * r),                              # square
        (yy <= 0.7 * r) & (yy >= -r + 2 * ax),                          # triangle, apex up
        (yy >= -0.7 * r) & (yy <= r - 2 * ax),                          # triangle, apex down
        ((ay <= t) & (ax <= r)) | ((ax <= t) & (ay <= r)),              # plus
        (np.abs(ay - ax) <= t * 1.2) & (ay <= 0.8 * r),                 # x cross
        (yy ** 2 + xx ** 2 <= r ** 2) & (yy ** 2 + xx ** 2 >= (0.55 * r) ** 2),   # ring
        (ay <= t) & (ax <= r),                                          # horizontal bar
        (ax <= t) & (ay <= r),                                          # vertical bar
        ay + ax <= r,                                                   # diamond
    ][kind]


def _shape_images(rng, labels, size=16):
    n = labels.size
    g = np.arange(size, dtype=np.float32)
    cy, cx = rng.uniform(4.5, size - 5.5, (2, n)).astype(np.float32)
    r = rng.uniform(3.0, 5.5, n).astype(np.float32)[:, None, None]
    yy = g[None, :, None] - cy[:, None, None]
    xx = g[None, None, :] - cx[:, None, None]
    mask = np.zeros((n, size, size), dtype=bool)
    for kind in range(10):
        sel = labels == kind
        if sel.any():
            mask[sel] = _shape_masks(kind, yy[sel], xx[sel], r[sel])
    # background: a random colour gradient; foreground: a random colour at a random contrast
    base = rng.uniform(0.2, 0.8, (n, 3, 1, 1)).astype(np.float32)
    grad = rng.normal(0.0, 0.25, (n, 3, 2)).astype(np.float32)
    bg = (base + grad[:, :, 0, None, None] * (g[None, None, :, None] / size - 0.5)
          + grad[:, :, 1, None, None] * (g[None, None, None, :] / size - 0.5))
    contrast = rng.uniform(0.25, 0.7, (n, 1, 1, 1)).astype(np.float32)
    direction = rng.normal(0.0, 1.0, (n, 3, 1, 1)).astype(np.float32)
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    fg = base + contrast * direction * np.sqrt(3.0)
    img = np.where(mask[:, None], fg, bg)
    # a distracting blob of random colour, and pixel noise
    by, bx = rng.uniform(0, size, (2, n)).astype(np.float32)
    d2 = (g[None, :, None] - by[:, None, None]) ** 2 + (g[None, None, :] - bx[:, None, None]) ** 2
    blob = np.exp(-d2 / (2 * 1.5 ** 2))[:, None] * rng.normal(0.0, 0.35, (n, 3, 1, 1))
    img = img + blob + rng.normal(0.0, 0.08, img.shape)
    return np.clip(np.round(img * 255.0), 0, 255).astype(np.uint8).reshape(n, -1)


def shapes(test_n=100_000, n=4000):
    rng = np.random.default_rng([22, 2])
    labels = rng.permutation(np.arange(n + test_n) % 10)
    x = np.empty((labels.size, 3 * 16 * 16), dtype=np.uint8)
    for a in range(0, labels.size, 8192):        # bounded memory
        x[a:a + 8192] = _shape_images(rng, labels[a:a + 8192])
    return _spec((x[:n], labels[:n]), (x[n:], labels[n:]), (3, 16, 16), np.uint8, "conv",
                 "image (colour, conv net)")


def longtail(test_n=80_000, n=4000):
    rng = np.random.default_rng([22, 3])
    k, d, clusters = 10, 24, 3
    freq = 0.65 ** np.arange(k)
    freq /= freq.sum()
    centres = rng.normal(0.0, 1.0, (k, clusters, d)) * 0.8
    labels = rng.choice(k, size=n + test_n, p=freq)
    which = rng.integers(0, clusters, labels.size)
    x = (centres[labels, which] + rng.normal(0.0, 1.0, (labels.size, d))).astype(np.float32)
    y = labels.copy()
    flipped = rng.random(labels.size) < 0.02
    y[flipped] = rng.integers(0, k, int(flipped.sum()))
    x = (x - x[:n].mean(0)) / x[:n].std(0)
    return _spec((x[:n], y[:n]), (x[n:], y[n:]), (d,), np.float32, "mlp",
                 "tabular, long-tailed classes")


KINDS = {"tabular": "tabular", "gratings-s": "image, MLP", "sequence": "text", "shapes": "image, conv",
         "longtail": "long-tailed"}
DATASETS = {"tabular": tabular, "gratings-s": gratings_s, "sequence": sequence,
            "shapes": shapes, "longtail": longtail}


def test_noise(accuracy_percent: float, test_n: int) -> float:
    """Sampling noise in points of an accuracy measured on `test_n` samples."""
    p = accuracy_percent / 100.0
    return 100.0 * float(np.sqrt(p * (1.0 - p) / test_n))
