"""Word lists the world generator draws names from.

Every word is a single token in the MiniLM WordPiece vocabulary (checked when the lists were
made), so that an entity is one or two tokens for the sharer. Lists are disjoint across kinds so
that a name never means two things. Order matters: the generator shuffles with a seeded RNG.
"""

from __future__ import annotations

__all__ = [
    "CITY_NAMES",
    "COMPANY_NAMES",
    "FIRST_NAMES",
    "INDUSTRIES",
    "LAST_NAMES",
    "PRODUCT_CATEGORIES",
    "PRODUCT_WORDS",
    "PROFESSIONS",
    "REGIONS",
]

FIRST_NAMES: tuple[str, ...] = tuple(
    """alice bruno clara david elena felix grace henry irene jonas karen leo maria nina oscar
    paula quinn rosa simon tara victor wendy xavier zane adam bella carl diana ethan fiona george
    hannah ivan julia kevin laura nora oliver peter rachel samuel sophie ursula vera walter boris
    chloe dennis edgar frank gloria hugo ingrid jack kyle lena marco nadia omar philip ruth sara
    tom vince wanda yusuf zoe abel beth cyrus dora emil faye gavin helen igor joan kurt lucy milo
    nell otto pia reid sean tina ulrich vivian ada ben cora dean eva finn gina hans jake kara liam
    mona ned olga paul rita sam theo ron max ella ruby jade noah luke mark anna emma lily mia owen
    ryan seth troy todd wade zack amy ann bob dan eli gus ian jill joe kim lou meg ray roy sue ted
    val""".split()  # noqa: SIM905
)

LAST_NAMES: tuple[str, ...] = tuple(
    """smith jones brown taylor wilson davies evans johnson roberts walker wright thompson white
    hughes edwards green hall wood harris lewis jackson clarke turner hill scott cooper morris ward
    moore king watson baker harrison morgan patel young allen mitchell anderson phillips lee bell
    parker davis""".split()  # noqa: SIM905
)

CITY_NAMES: tuple[str, ...] = tuple(
    """avalon brighton camden dover easton harlow kingston milton newport oxford preston redwood
    salem trenton vernon weston york ashton belmont clifton denton fulton hudson irvine kenton
    norwood quincy ripley stanton thornton""".split()  # noqa: SIM905
)

COMPANY_NAMES: tuple[str, ...] = tuple(
    """apex zenith vertex pixel quantum summit atlas beacon cobalt delta falcon granite harbor
    ivory meridian pinnacle quartz radiant sterling titan vortex willow crimson aurora horizon
    cascade""".split()  # noqa: SIM905
)

PRODUCT_WORDS: tuple[str, ...] = tuple(
    """glide spark echo pulse breeze comet drift flare glow halo jet lotus mist prism ripple
    shadow storm tide vapor wave blaze frost arrow bolt cloud dusk fable gem haze lark maple
    nectar raven sage thorn velvet wren birch cedar dune fern nova orbit""".split()  # noqa: SIM905
)

PRODUCT_CATEGORIES: tuple[str, ...] = (
    "phone", "laptop", "camera", "drone", "watch", "speaker", "bicycle", "lamp", "tablet",
    "printer",
)

PROFESSIONS: tuple[str, ...] = (
    "engineer", "doctor", "teacher", "lawyer", "chef", "pilot", "nurse", "artist", "farmer",
    "writer",
)

INDUSTRIES: tuple[str, ...] = (
    "software", "energy", "shipping", "banking", "food", "textiles", "mining", "furniture",
)

REGIONS: tuple[str, ...] = ("north", "south", "east", "west", "center")
