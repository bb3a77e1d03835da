"""The PGP word list, and choosing and completing the words of a wormhole code.

Compatible with magic-wormhole 0.24 (``wormhole._wordlist``): a code's words
alternate between the odd and even lists, starting with an odd word, all
lowercase and joined by hyphens (``7-guitarist-revenge``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable

__all__ = [
    "EVEN_WORDS",
    "ODD_WORDS",
    "choose_words",
    "code_completions",
    "word_completions",
]

# The PGP word list (https://en.wikipedia.org/wiki/PGP_Words), indexed by byte value.
# fmt: off
EVEN_WORDS: tuple[str, ...] = (
    "aardvark", "absurd", "accrue", "acme",  # 0x00
    "adrift", "adult", "afflict", "ahead",  # 0x04
    "aimless", "algol", "allow", "alone",  # 0x08
    "ammo", "ancient", "apple", "artist",  # 0x0c
    "assume", "athens", "atlas", "aztec",  # 0x10
    "baboon", "backfield", "backward", "banjo",  # 0x14
    "beaming", "bedlamp", "beehive", "beeswax",  # 0x18
    "befriend", "belfast", "berserk", "billiard",  # 0x1c
    "bison", "blackjack", "blockade", "blowtorch",  # 0x20
    "bluebird", "bombast", "bookshelf", "brackish",  # 0x24
    "breadline", "breakup", "brickyard", "briefcase",  # 0x28
    "burbank", "button", "buzzard", "cement",  # 0x2c
    "chairlift", "chatter", "checkup", "chisel",  # 0x30
    "choking", "chopper", "christmas", "clamshell",  # 0x34
    "classic", "classroom", "cleanup", "clockwork",  # 0x38
    "cobra", "commence", "concert", "cowbell",  # 0x3c
    "crackdown", "cranky", "crowfoot", "crucial",  # 0x40
    "crumpled", "crusade", "cubic", "dashboard",  # 0x44
    "deadbolt", "deckhand", "dogsled", "dragnet",  # 0x48
    "drainage", "dreadful", "drifter", "dropper",  # 0x4c
    "drumbeat", "drunken", "dupont", "dwelling",  # 0x50
    "eating", "edict", "egghead", "eightball",  # 0x54
    "endorse", "endow", "enlist", "erase",  # 0x58
    "escape", "exceed", "eyeglass", "eyetooth",  # 0x5c
    "facial", "fallout", "flagpole", "flatfoot",  # 0x60
    "flytrap", "fracture", "framework", "freedom",  # 0x64
    "frighten", "gazelle", "geiger", "glitter",  # 0x68
    "glucose", "goggles", "goldfish", "gremlin",  # 0x6c
    "guidance", "hamlet", "highchair", "hockey",  # 0x70
    "indoors", "indulge", "inverse", "involve",  # 0x74
    "island", "jawbone", "keyboard", "kickoff",  # 0x78
    "kiwi", "klaxon", "locale", "lockup",  # 0x7c
    "merit", "minnow", "miser", "mohawk",  # 0x80
    "mural", "music", "necklace", "neptune",  # 0x84
    "newborn", "nightbird", "oakland", "obtuse",  # 0x88
    "offload", "optic", "orca", "payday",  # 0x8c
    "peachy", "pheasant", "physique", "playhouse",  # 0x90
    "pluto", "preclude", "prefer", "preshrunk",  # 0x94
    "printer", "prowler", "pupil", "puppy",  # 0x98
    "python", "quadrant", "quiver", "quota",  # 0x9c
    "ragtime", "ratchet", "rebirth", "reform",  # 0xa0
    "regain", "reindeer", "rematch", "repay",  # 0xa4
    "retouch", "revenge", "reward", "rhythm",  # 0xa8
    "ribcage", "ringbolt", "robust", "rocker",  # 0xac
    "ruffled", "sailboat", "sawdust", "scallion",  # 0xb0
    "scenic", "scorecard", "scotland", "seabird",  # 0xb4
    "select", "sentence", "shadow", "shamrock",  # 0xb8
    "showgirl", "skullcap", "skydive", "slingshot",  # 0xbc
    "slowdown", "snapline", "snapshot", "snowcap",  # 0xc0
    "snowslide", "solo", "southward", "soybean",  # 0xc4
    "spaniel", "spearhead", "spellbind", "spheroid",  # 0xc8
    "spigot", "spindle", "spyglass", "stagehand",  # 0xcc
    "stagnate", "stairway", "standard", "stapler",  # 0xd0
    "steamship", "sterling", "stockman", "stopwatch",  # 0xd4
    "stormy", "sugar", "surmount", "suspense",  # 0xd8
    "sweatband", "swelter", "tactics", "talon",  # 0xdc
    "tapeworm", "tempest", "tiger", "tissue",  # 0xe0
    "tonic", "topmost", "tracker", "transit",  # 0xe4
    "trauma", "treadmill", "trojan", "trouble",  # 0xe8
    "tumor", "tunnel", "tycoon", "uncut",  # 0xec
    "unearth", "unwind", "uproot", "upset",  # 0xf0
    "upshot", "vapor", "village", "virus",  # 0xf4
    "vulcan", "waffle", "wallet", "watchword",  # 0xf8
    "wayside", "willow", "woodlark", "zulu",  # 0xfc
)

ODD_WORDS: tuple[str, ...] = (
    "adroitness", "adviser", "aftermath", "aggregate",  # 0x00
    "alkali", "almighty", "amulet", "amusement",  # 0x04
    "antenna", "applicant", "apollo", "armistice",  # 0x08
    "article", "asteroid", "atlantic", "atmosphere",  # 0x0c
    "autopsy", "babylon", "backwater", "barbecue",  # 0x10
    "belowground", "bifocals", "bodyguard", "bookseller",  # 0x14
    "borderline", "bottomless", "bradbury", "bravado",  # 0x18
    "brazilian", "breakaway", "burlington", "businessman",  # 0x1c
    "butterfat", "camelot", "candidate", "cannonball",  # 0x20
    "capricorn", "caravan", "caretaker", "celebrate",  # 0x24
    "cellulose", "certify", "chambermaid", "cherokee",  # 0x28
    "chicago", "clergyman", "coherence", "combustion",  # 0x2c
    "commando", "company", "component", "concurrent",  # 0x30
    "confidence", "conformist", "congregate", "consensus",  # 0x34
    "consulting", "corporate", "corrosion", "councilman",  # 0x38
    "crossover", "crucifix", "cumbersome", "customer",  # 0x3c
    "dakota", "decadence", "december", "decimal",  # 0x40
    "designing", "detector", "detergent", "determine",  # 0x44
    "dictator", "dinosaur", "direction", "disable",  # 0x48
    "disbelief", "disruptive", "distortion", "document",  # 0x4c
    "embezzle", "enchanting", "enrollment", "enterprise",  # 0x50
    "equation", "equipment", "escapade", "eskimo",  # 0x54
    "everyday", "examine", "existence", "exodus",  # 0x58
    "fascinate", "filament", "finicky", "forever",  # 0x5c
    "fortitude", "frequency", "gadgetry", "galveston",  # 0x60
    "getaway", "glossary", "gossamer", "graduate",  # 0x64
    "gravity", "guitarist", "hamburger", "hamilton",  # 0x68
    "handiwork", "hazardous", "headwaters", "hemisphere",  # 0x6c
    "hesitate", "hideaway", "holiness", "hurricane",  # 0x70
    "hydraulic", "impartial", "impetus", "inception",  # 0x74
    "indigo", "inertia", "infancy", "inferno",  # 0x78
    "informant", "insincere", "insurgent", "integrate",  # 0x7c
    "intention", "inventive", "istanbul", "jamaica",  # 0x80
    "jupiter", "leprosy", "letterhead", "liberty",  # 0x84
    "maritime", "matchmaker", "maverick", "medusa",  # 0x88
    "megaton", "microscope", "microwave", "midsummer",  # 0x8c
    "millionaire", "miracle", "misnomer", "molasses",  # 0x90
    "molecule", "montana", "monument", "mosquito",  # 0x94
    "narrative", "nebula", "newsletter", "norwegian",  # 0x98
    "october", "ohio", "onlooker", "opulent",  # 0x9c
    "orlando", "outfielder", "pacific", "pandemic",  # 0xa0
    "pandora", "paperweight", "paragon", "paragraph",  # 0xa4
    "paramount", "passenger", "pedigree", "pegasus",  # 0xa8
    "penetrate", "perceptive", "performance", "pharmacy",  # 0xac
    "phonetic", "photograph", "pioneer", "pocketful",  # 0xb0
    "politeness", "positive", "potato", "processor",  # 0xb4
    "provincial", "proximate", "puberty", "publisher",  # 0xb8
    "pyramid", "quantity", "racketeer", "rebellion",  # 0xbc
    "recipe", "recover", "repellent", "replica",  # 0xc0
    "reproduce", "resistor", "responsive", "retraction",  # 0xc4
    "retrieval", "retrospect", "revenue", "revival",  # 0xc8
    "revolver", "sandalwood", "sardonic", "saturday",  # 0xcc
    "savagery", "scavenger", "sensation", "sociable",  # 0xd0
    "souvenir", "specialist", "speculate", "stethoscope",  # 0xd4
    "stupendous", "supportive", "surrender", "suspicious",  # 0xd8
    "sympathy", "tambourine", "telephone", "therapist",  # 0xdc
    "tobacco", "tolerance", "tomorrow", "torpedo",  # 0xe0
    "tradition", "travesty", "trombonist", "truncated",  # 0xe4
    "typewriter", "ultimate", "undaunted", "underfoot",  # 0xe8
    "unicorn", "unify", "universe", "unravel",  # 0xec
    "upcoming", "vacancy", "vagabond", "vertigo",  # 0xf0
    "virginia", "visitor", "vocalist", "voyager",  # 0xf4
    "warranty", "waterloo", "whimsical", "wichita",  # 0xf8
    "wilmington", "wyoming", "yesteryear", "yucatan",  # 0xfc
)
# fmt: on

_EVEN_SET: frozenset[str] = frozenset(EVEN_WORDS)
_ODD_SET: frozenset[str] = frozenset(ODD_WORDS)


def _secure_randbyte() -> int:
    return secrets.randbelow(256)


def choose_words(length: int, randbyte: Callable[[], int] | None = None) -> str:
    """Return ``length`` random words joined by "-", alternating odd/even, odd first.

    ``randbyte`` returns a byte value (0-255); it defaults to a secure random
    source and exists so tests can be deterministic.
    """
    rand = randbyte or _secure_randbyte
    words = []
    for i in range(length):
        value = rand()
        if not 0 <= value <= 255:
            raise ValueError(f"randbyte() returned {value!r}, not a byte value (0-255)")
        # We start with an "odd word", like the reference.
        words.append(ODD_WORDS[value] if i % 2 == 0 else EVEN_WORDS[value])
    return "-".join(words)


def word_completions(words_prefix: str, num_words: int = 2) -> set[str]:
    """Completions of the words part of a code (the text after "nameplate-").

    Same results as the reference ``PGPWordList.get_completions``: each
    completion is ``words_prefix`` with its last partial word completed, plus a
    trailing "-" when more words are expected.
    """
    count = words_prefix.count("-")
    words = _ODD_SET if count % 2 == 0 else _EVEN_SET
    last_partial_word = words_prefix.split("-")[-1]
    head = words_prefix[: len(words_prefix) - len(last_partial_word)]
    suffix = "-" if count + 1 < num_words else ""
    return {head + word + suffix for word in words if word.startswith(last_partial_word)}


def code_completions(text: str, nameplates: Iterable[str] = (), num_words: int = 2) -> list[str]:
    """Sorted completions of a partly typed code, for the interactive prompt.

    Without a "-" in ``text`` this completes the nameplate (from ``nameplates``,
    each followed by "-"); after it, the words. Nothing is offered once
    ``num_words`` words have been typed.
    """
    if "-" not in text:
        return sorted({nameplate + "-" for nameplate in nameplates if nameplate.startswith(text)})
    nameplate, words = text.split("-", 1)
    if words.count("-") >= num_words:
        return []
    return sorted(nameplate + "-" + c for c in word_completions(words, num_words))
