"""A multi-domain parallel corpus: up to eight invented source dialects, one target language.

Every sentence pair starts from one English-like target sentence drawn from a small grammar
(subject, verb, object, optional prepositional phrase; optional adjectives). Each source dialect
renders it with

  * the same word forms as every other dialect, but its own meanings for them: one shared pool of
    invented words, assigned to the target words by a different permutation per dialect ("false
    friends" everywhere). A source word tells you nothing until you know the dialect;
  * its own word order, applied to the phrase structure (not to the flat word list): constituent
    order (SVO, SOV, VSO, ...), adjectives and determiners before or after the noun, prepositions
    or postpositions, or the whole sentence mirrored;
  * sometimes its own function words (case particles) that have no target counterpart.

So the meaning of a token is a function of (token, dialect): a different job per dialect, which is
what a mixture of experts can split between experts. The dialect of every line is written to
``{split}.domain``; the main job prepends it as a ``<2dialect>`` token after sentencepiece, as
multilingual NMT does with language tags.

Writes ``{split}.src``, ``{split}.tgt`` and ``{split}.domain`` for train, valid and test;
deterministic for a given ``--seed``. Dialects alternate line by line, and no valid or test target
sentence occurs in training.
"""

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

DETS = ["the", "a", "this", "that", "every", "some", "no", "one"]
# fmt: off
ADJS = ["red", "small", "old", "quiet", "bright", "heavy", "young", "cold", "green", "tall", "strange", "happy",
        "dark", "warm", "empty", "gentle", "broken", "clever", "tired", "golden", "narrow", "wild", "lonely", "proud"]
# fmt: on
# fmt: off
NOUNS = ["fox", "river", "teacher", "house", "bird", "child", "stone", "boat", "farmer", "tree", "letter",
         "horse", "market", "window", "doctor", "garden", "song", "bridge", "cat", "lamp", "king", "mirror",
         "forest", "sailor", "candle", "wolf", "village", "painter", "road", "basket", "tower", "queen",
         "island", "baker", "cloud", "door", "soldier", "kettle", "mountain", "student", "apple", "ladder",
         "shadow", "priest", "wagon", "flower", "hunter", "bell"]
# fmt: on
# fmt: off
VERBS = ["sees", "finds", "carries", "paints", "follows", "builds", "hears", "loves", "opens", "watches",
         "remembers", "sells", "breaks", "hides", "feeds", "fears", "pulls", "greets", "washes", "leaves",
         "chases", "draws", "keeps", "visits", "forgets", "calls", "burns", "lifts", "praises", "counts"]
# fmt: on
PREPS = ["near", "under", "behind", "with", "without", "beside", "above", "inside"]
TARGET_WORDS = DETS + ADJS + NOUNS + VERBS + PREPS
ONSETS, VOWELS, CODAS = "b d g k l m n p r s t v z".split(), "a e i o u".split(), ["", "", "", "n", "r"]


# fmt: off
@dataclass(frozen=True)
class Dialect:
    order: str  # constituent order: S(ubject) V(erb) O(bject) P(repositional phrase)
    noun_phrase: str = "det adj noun"  # word order inside a noun phrase
    postpositions: bool = False  # "near the tree" -> "the tree near"
    particles: tuple = (None, None)  # function words after the subject and after the object
    mirrored: bool = False  # the finished sentence read backwards
# fmt: on


# fmt: off
DIALECTS = {
    "lowland": Dialect("SVOP"),
    "harbor": Dialect("SPOV", "det noun adj", postpositions=True, particles=("ga", "wo")),
    "highland": Dialect("SVOP", mirrored=True),
    "desert": Dialect("VOSP", particles=("el", None)),
    "marsh": Dialect("SVOP", "det noun adj"),
    "coast": Dialect("VSOP", "det noun adj"),
    "valley": Dialect("OSVP", particles=(None, "ka")),
    "steppe": Dialect("PSOV", "noun adj det", postpositions=True),
}
# fmt: on
PARTICLES = {p for d in DIALECTS.values() for p in d.particles if p}


def word_pool(rng: random.Random, size: int) -> list:
    """SIZE invented words, distinct, never a particle."""
    pool = []
    while len(pool) < size:
        syllables = rng.choice([2, 2, 3])
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)) + rng.choice(CODAS)
        if word not in pool and word not in PARTICLES:
            pool.append(word)
    return pool


def dialect_lexicons(rng: random.Random, synonyms: int = 1) -> dict:
    """Every dialect uses the whole pool, each with its own meanings (no word keeps one across all).

    Each target word gets SYNONYMS source forms per dialect (a tuple), so a dialect has SYNONYMS
    times as many word-meaning pairs to learn from the same number of sentences: the corpus's
    difficulty knob. A form still has one meaning per dialect, so translation stays unambiguous.
    """
    pool = word_pool(rng, len(TARGET_WORDS) * synonyms)
    lexicons = {}
    for name in DIALECTS:
        forms = pool[:]
        rng.shuffle(forms)
        lexicons[name] = {word: tuple(forms[i * synonyms : (i + 1) * synonyms]) for i, word in enumerate(TARGET_WORDS)}
    return lexicons


def noun_phrase(rng: random.Random) -> list:
    return [rng.choice(DETS)] + ([rng.choice(ADJS)] if rng.random() < 0.5 else []) + [rng.choice(NOUNS)]


def sentence(rng: random.Random) -> dict:
    """A parsed target sentence: phrases, each a list of words."""
    return {
        "subj": noun_phrase(rng),
        "verb": [rng.choice(VERBS)],
        "obj": noun_phrase(rng),
        "pp": [rng.choice(PREPS)] + noun_phrase(rng) if rng.random() < 0.5 else [],
    }


def render_phrase(words: list, dialect: Dialect) -> list:
    """A noun phrase (det [adj] noun) in the dialect's order."""
    slots = {"det": words[0], "adj": words[1] if len(words) == 3 else None, "noun": words[-1]}
    return [slots[slot] for slot in dialect.noun_phrase.split() if slots[slot]]


def reorder(parse: dict, dialect: Dialect) -> list:
    after_subj, after_obj = dialect.particles
    pp = []
    if parse["pp"]:
        prep, np = parse["pp"][:1], render_phrase(parse["pp"][1:], dialect)
        pp = np + prep if dialect.postpositions else prep + np
    constituents = {
        "S": render_phrase(parse["subj"], dialect) + ([after_subj] if after_subj else []),
        "V": parse["verb"],
        "O": render_phrase(parse["obj"], dialect) + ([after_obj] if after_obj else []),
        "P": pp,
    }
    words = [w for c in dialect.order for w in constituents[c]]
    return words[::-1] if dialect.mirrored else words


def render(parse: dict, name: str, lexicon: dict, rng: random.Random) -> str:
    # Particles are dialect words already; everything else goes through the lexicon. The rng is
    # only drawn from when there is a choice, so SYNONYMS=1 writes the corpus it always wrote.
    words = []
    for w in reorder(parse, DIALECTS[name]):
        forms = lexicon.get(w, (w,))
        words.append(forms[0] if len(forms) == 1 else rng.choice(forms))
    return " ".join(words)


def target(parse: dict) -> str:
    return " ".join(parse["subj"] + parse["verb"] + parse["obj"] + parse["pp"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--train", type=int, default=3000, help="training pairs per dialect")
    parser.add_argument("--valid", type=int, default=100, help="validation pairs per dialect")
    parser.add_argument("--test", type=int, default=200, help="test pairs per dialect")
    parser.add_argument("--dialects", type=int, default=len(DIALECTS), help=f"how many of the {len(DIALECTS)} dialects")
    parser.add_argument(
        "--synonyms",
        type=int,
        default=1,
        help="source forms per target word per dialect (more = harder: more to learn)",
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if not 1 <= args.dialects <= len(DIALECTS):
        parser.error(f"--dialects must be between 1 and {len(DIALECTS)}")
    if args.synonyms < 1:
        parser.error(f"--synonyms must be 1 or more, got {args.synonyms}")

    rng = random.Random(args.seed)
    names = list(DIALECTS)[: args.dialects]
    lexicons = dialect_lexicons(rng, args.synonyms)
    args.outdir.mkdir(parents=True, exist_ok=True)
    seen = set()
    for split in ("train", "valid", "test"):
        src, tgt, dom = [], [], []
        for i in range(getattr(args, split) * len(names)):
            name = names[i % len(names)]
            while True:  # keep test and valid sentences out of training
                parse = sentence(rng)
                if target(parse) not in seen:
                    break
            seen.add(target(parse))
            src.append(render(parse, name, lexicons[name], rng))
            tgt.append(target(parse))
            dom.append(name)
        for ext, lines in (("src", src), ("tgt", tgt), ("domain", dom)):
            (args.outdir / f"{split}.{ext}").write_text("\n".join(lines) + "\n")
    for name in names:
        print(f"{name:>9}: {render(sentence(random.Random(7)), name, lexicons[name], random.Random(7))}")
    print(f"{'target':>9}: {target(sentence(random.Random(7)))}")


if __name__ == "__main__":
    main()
