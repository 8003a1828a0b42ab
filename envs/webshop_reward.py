"""WebShop's purchase reward (Yao et al., 2022), re-implemented for webshop-mini.

The function names, arguments, return values and dict keys are those of WebShop's
`web_agent_site/engine/goal.py`, so WebShop's own reward tests run against this module
unchanged. With n_att goal attributes and n_opt goal options:

    reward = r_type * (attributes matched + options matched + [price <= price_upper])
                    / (n_att + n_opt + 1)

- r_type (get_type_reward): 1.0 when the purchase is the same kind of product (same search
  query, or >= 2 shared product_category levels, or title_score > 0.2); 0.5 when none of those
  hold; 0.1 when title_score < 0.1; 0.0 when title_score == 0. title_score is the share of the
  goal title's nouns that also occur in the purchased title.
- an attribute matches when fuzz.token_set_ratio > 85 against one of the product's Attributes,
  or when it occurs verbatim in its title, bullet points or description.
- an option matches when fuzz.token_set_ratio > 85 against one of the options the agent clicked,
  after WebShop's colour normalisation (a value containing a known colour name becomes that name).

What differs from WebShop:
- Nouns. WebShop tags the titles with spaCy's en_core_web_sm and keeps NOUN/PROPN tokens;
  spaCy cannot be installed here, so `title_nouns` approximates it: the lower-cased title words
  minus stop words, numbers and a short list of adjectives and participles frequent in product
  titles. The thresholds above are WebShop's; on WebShop's own test titles this gives the same
  title scores (6/7, 5/16, 2/12, 0).
- Fuzzy matching uses rapidfuzz with its default preprocessing (lower-case, punctuation to
  spaces) and rounds to an integer, which is what thefuzz (WebShop's dependency) does.
- A goal without a price limit (price_upper <= 0) or without attributes leaves that term out of
  the sum instead of failing.
"""
from __future__ import annotations

import re

from rapidfuzz import fuzz, utils

FUZZY_THRESHOLD = 85

# WebShop's colour list (web_agent_site/engine/normalize.py), in its order: the first
# name contained in an option value wins, so "light blue" normalises to "blue".
COLOR_SET = (
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue",
    "blush", "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne",
    "charcoal", "cheetah", "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper",
    "coral", "cranberry", "cream", "crystal", "dark", "denim", "eggplant", "elephant", "espresso",
    "fuchsia", "gold", "granite", "grape", "graphite", "grass", "gray", "green", "grey", "heather",
    "indigo", "ivory", "ivy", "khaki", "lavender", "lemon", "leopard", "light", "lilac", "lime",
    "magenta", "maroon", "mauve", "merlot", "midnight", "mint", "mocha", "multicolor", "mushroom",
    "mustard", "natural", "navy", "nude", "olive", "orange", "peach", "pewter", "pink", "plum",
    "purple", "rainbow", "red", "rose", "royal", "rust", "sand", "sapphire", "seashell", "silver",
    "skull", "slate", "steel", "stone", "stonewash", "sunflower", "tan", "taupe", "teal", "tiger",
    "turquoise", "violet", "walnut", "wheat", "white", "wine", "yellow",
)


def normalize_color(color_string: str) -> str:
    """The first WebShop colour name found inside the value, else the value unchanged."""
    for name in COLOR_SET:
        if name in color_string:
            return name
    return color_string


def fuzzy_score(a: str, b: str) -> int:
    """thefuzz's token_set_ratio: processed strings, rounded to an integer."""
    return int(round(fuzz.token_set_ratio(a, b, processor=utils.default_process)))


# --- the noun approximation ---------------------------------------------------------------
STOP_WORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before
being below between both but by can could did do does doing down during each few for from
further had has have having he her here hers him his how i if in into is it its itself just
me more most my no nor not now of off on once only or other our ours out over own same she
should so some such than that the their them then there these they this those through to too
under until up very was we were what when where which while who whom why will with would you
your yours w x per via plus amp
""".split())

# Adjectives, participles and adverbs that spaCy does not tag as nouns but that are frequent in
# product titles; without them every "new", "premium" or "long" would count as a type noun.
NON_NOUN_WORDS = frozenset("""
listed ultra new best great good premium deluxe classic original genuine professional
portable adjustable foldable washable durable compatible replacement rechargeable wireless
waterproof breathable lightweight heavy light large small mini big extra super soft hard
long short lasting high low deep full quick fast slow easy non free natural organic pure fresh
real sweet dark bright clear warm cool hot cold dry wet thick thin wide narrow tall round square
flat slim open closed multi anti daily extra strong gentle sensitive smooth comfortable cute
pretty elegant modern vintage rustic casual formal solid stainless cordless ergonomic compact
reusable eco friendly handmade assorted unscented scented vegan matte glossy
non-slip nonslip padded insulated polarized sleeveless oversized fitted loose plain printed
woven knitted quilted cushioned reinforced certified tested approved designed made
""".split())

_SPLIT = re.compile(r"[^\w.']+")
_NUMBER = re.compile(r"^[\d.,']+$")


def title_nouns(title: str) -> list[str]:
    """Stand-in for spaCy's NOUN/PROPN tokens of a title (a list: repeats count, as in WebShop)."""
    out = []
    for raw in _SPLIT.split(title.lower()):
        word = raw.strip(".'")
        if len(word) < 2 or _NUMBER.match(word) or word in STOP_WORDS or word in NON_NOUN_WORDS:
            continue
        out.append(word)
    return out


# --- WebShop's reward functions -----------------------------------------------------------
def get_type_reward(purchased_product: dict, goal: dict) -> dict:
    """Is the purchase the same kind of product as the goal? (query, category path, title nouns)"""
    query_match = purchased_product["query"] == goal["query"]
    purchased_path = {part.strip() for part in purchased_product["product_category"].split("›")}
    goal_path = {part.strip() for part in goal["product_category"].split("›")}
    category_match = len(purchased_path & goal_path) >= 2

    desired = title_nouns(goal["name"])
    purchased = set(title_nouns(purchased_product["name"]))
    # the denominator counts repeated goal nouns, the numerator distinct shared ones (as WebShop)
    title_score = 0.2 if not desired else len(set(desired) & purchased) / len(desired)

    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return dict(r_type=r_type, query_match=query_match, category_match=category_match,
                title_score=title_score)


def get_attribute_reward(purchased_product: dict, goal: dict) -> tuple:
    """(share of goal attributes the product has, number matched)."""
    goal_attrs = goal["attributes"]
    matched = 0
    for g_attr in goal_attrs:
        if any(fuzzy_score(p_attr, g_attr) > FUZZY_THRESHOLD for p_attr in purchased_product["Attributes"]):
            matched += 1
        # otherwise look for the words themselves; keys are read only when needed, as in WebShop
        elif (g_attr in purchased_product["Title"].lower()
              or g_attr in " ".join(purchased_product["BulletPoints"]).lower()
              or g_attr in purchased_product["Description"].lower()):
            matched += 1
    r_attr = matched / len(goal_attrs) if goal_attrs else None
    return r_attr, matched


def get_option_reward(purchased_options, goal_options) -> tuple:
    """(share of goal options among the clicked ones, number matched); None share if no goal options."""
    purchased = [normalize_color(o) for o in purchased_options]
    wanted = [normalize_color(o) for o in goal_options]
    matched = sum(1 for g in wanted if any(fuzzy_score(p, g) > FUZZY_THRESHOLD for p in purchased))
    r_option = matched / len(wanted) if wanted else None
    return r_option, matched


def get_reward(purchased_product: dict, goal: dict, price: float, options: dict, **kwargs):
    """WebShop's total reward in [0, 1]; with verbose=True also a dict of the parts."""
    r_type_dict = get_type_reward(purchased_product, goal)
    r_price = (price <= goal["price_upper"]) if goal["price_upper"] > 0 else None
    r_att, n_att = get_attribute_reward(purchased_product, goal)
    goal_options = goal["goal_options"]
    goal_values = list(goal_options.values()) if isinstance(goal_options, dict) else list(goal_options)
    r_option, n_opt = get_option_reward(list(options.values()), goal_values)

    n_parts = len(goal["attributes"]) + len(goal_values) + (1 if r_price is not None else 0)
    total = (n_att + n_opt + int(bool(r_price))) / n_parts if n_parts else 1.0
    total *= r_type_dict["r_type"]

    if not kwargs.get("verbose", False):
        return total
    info = {"r_type": r_type_dict["r_type"], "r_att": r_att,
            "w_att": len(goal["attributes"]) / max(n_parts, 1),
            "query_match": r_type_dict["query_match"], "category_match": r_type_dict["category_match"],
            "title_score": r_type_dict["title_score"]}
    if r_option is not None:
        info["r_option"], info["w_option"] = r_option, len(goal_values) / n_parts
    if r_price is not None:
        info["r_price"], info["w_price"] = r_price, 1 / n_parts
    return total, info
