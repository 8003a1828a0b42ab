"""The data behind webshop-mini: a shipped catalog generator and a loader for WebShop's own files.

Both return the same thing, products and goals in WebShop's processed format:

- product: asin, name, Title, category, query, product_category, Price (the text shown),
  pricing (list of floats), options {group: [values]}, Attributes, BulletPoints, Description,
  Rating, Reviews.
- goal (WebShop's goal dict): asin, category, query, name, product_category,
  instruction_text, attributes, price_upper, goal_options (a list of option values), weight.

The shipped catalog (`generate_catalog`) is built in-process from the table below with a fixed
seed: 37 product types in 12 categories, 36 products per type (1,332 products), two goals per
product (2,664 goals). Nine product types are held out as the "ood" split (648 goals); of the
other 28, a quarter of each type's products (9 of 36) are targets of "test" goals (504), every
ninth of the other 27 (3 a type) of "val" goals (168, for choosing hyper-parameters) and the
remaining 24 of "train" goals (1,344), so test and val goals are new instructions for new target
products of known types. Every instruction text is unique across the catalog. The val goals
were train goals before val existed (train had 1,512); the goals themselves and the test and
ood splits are the same as then. The instructions follow WebShop's human instructions:
"i need a long lasting lipstick in red, and price lower than 30.00 dollars".

`load_webshop_dir` reads WebShop's items_shuffle_1000.json, items_human_ins.json and, when
present, items_ins_v2_1000.json, and processes them as WebShop's engine.load_products and
goal.get_human_goals do (see that function for the differences).
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from decimal import Decimal

CATALOG_SEED = 20220701
PRODUCTS_PER_TYPE = 36
GOALS_PER_PRODUCT = 2
TEST_SHARE = 0.25
VAL_EVERY = 9      # every ninth of a type's non-test products is a val target (3 of 27)
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # WebShop's price limits: multiples of 10


@dataclass(frozen=True)
class ProductType:
    key: str
    category: str
    path: str                      # product_category, levels joined by " › "
    query: str
    noun: str                      # head of the product title
    say: tuple                     # how a shopper names it in an instruction
    attrs: tuple                   # "+x" = said as "with x"; stored without the "+"
    options: dict = field(default_factory=dict)
    price: tuple = (10, 50)
    blurb: str = ""
    plural: bool = False
    ood: bool = False


T = ProductType
PRODUCT_TYPES = (
    # beauty
    T("lipstick", "beauty", "Beauty & Personal Care › Makeup › Lips › Lipstick",
      "lipstick", "Lipstick", ("lipstick",),
      ("long lasting", "matte finish", "cruelty free", "paraben free", "moisturizing", "waterproof", "vegan"),
      {"color": ("red", "nude", "pink", "coral", "plum", "mauve", "burgundy")}, (6, 32),
       "A creamy lip color that glides on in one stroke."),
    T("face-serum", "beauty", "Beauty & Personal Care › Skin Care › Face › Serums",
      "face serum", "Face Serum", ("face serum", "facial serum"),
      ("+hyaluronic acid", "+vitamin c", "fragrance free", "anti aging", "oil free", "sensitive skin",
       "dermatologist tested"),
      {"size": ("15 ml", "30 ml", "100 ml")}, (9, 45), "A lightweight serum for morning and night routines."),
    T("shampoo", "beauty", "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
      "shampoo", "Shampoo", ("shampoo",),
      ("sulfate free", "+tea tree", "+argan oil", "color safe", "dry scalp", "curly hair", "+natural ingredients"),
      {"scent": ("coconut", "lavender", "citrus", "rose"), "size": ("250 ml", "1 liter")}, (7, 38),
       "Cleanses without stripping and rinses out clean."),
    T("nail-polish", "beauty", "Beauty & Personal Care › Makeup › Nails › Nail Polish",
      "nail polish", "Nail Polish", ("nail polish",),
      ("quick dry", "chip resistant", "non toxic", "gel effect", "long wearing", "cruelty free"),
      {"color": ("red", "black", "nude", "lilac", "teal", "gold")}, (5, 22),
       "High shine color in a single coat.", ood=True),
    # fashion
    T("mens-tshirt", "fashion", "Clothing, Shoes & Jewelry › Men › Clothing › Shirts › T-Shirts",
      "men's t-shirt", "Men's T-Shirt", ("t-shirt for men", "men's t-shirt"),
      ("short sleeve", "crew neck", "slim fit", "moisture wicking", "machine wash", "cotton blend"),
      {"color": ("black", "white", "navy", "grey", "olive", "red"), "size": ("small", "medium", "large", "xl",
       "2xl")}, (9, 35), "An everyday tee with a soft hand feel."),
    T("womens-dress", "fashion", "Clothing, Shoes & Jewelry › Women › Clothing › Dresses",
      "women's dress", "Women's Dress", ("dress for women", "women's dress"),
      ("floral print", "v neck", "long sleeve", "midi length", "+side pockets", "high waist", "flowy"),
      {"color": ("black", "blue", "red", "green", "pink", "white", "yellow"), "size": ("small", "medium", "large",
       "xl")}, (18, 60), "A relaxed dress that works from brunch to evening."),
    T("rain-jacket", "fashion", "Clothing, Shoes & Jewelry › Men › Clothing › Jackets & Coats › Rain Jackets",
      "rain jacket", "Rain Jacket", ("rain jacket",),
      ("waterproof", "hooded", "packable", "windproof", "+zip pockets", "seam sealed"),
      {"color": ("black", "navy", "yellow", "olive", "red"), "size": ("small", "medium", "large", "xl")}, (25, 90),
       "A shell that keeps the weather out on the way to work.", ood=True),
    # shoes
    T("running-shoes", "shoes", "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
      "running shoes", "Running Shoes", ("running shoes",),
      ("breathable mesh", "rubber sole", "arch support", "non slip", "+memory foam insole", "lightweight"),
      {"color": ("black", "white", "grey", "blue", "red"), "size": ("7", "8", "9", "10", "11", "12")}, (30, 110),
       "A cushioned trainer for daily miles.", plural=True),
    T("sandals", "shoes", "Clothing, Shoes & Jewelry › Women › Shoes › Sandals",
      "women's sandals", "Women's Sandals", ("sandals for women", "women's sandals"),
      ("open toe", "ankle strap", "arch support", "flat sole", "+cushioned footbed", "vegan leather"),
      {"color": ("black", "brown", "beige", "white", "gold"), "size": ("6", "7", "8", "9", "10")}, (15, 60),
       "A summer sandal that goes with everything.", plural=True),
    T("hiking-boots", "shoes", "Clothing, Shoes & Jewelry › Men › Shoes › Outdoor › Hiking Boots",
      "hiking boots", "Hiking Boots", ("hiking boots",),
      ("waterproof", "ankle support", "lug sole", "lace up", "insulated", "slip resistant"),
      {"color": ("brown", "black", "grey", "khaki"), "size": ("7", "8", "9", "10", "11", "12")}, (45, 160),
       "A trail boot built for rocky ground.", plural=True, ood=True),
    # grocery
    T("coffee-beans", "grocery", "Grocery & Gourmet Food › Beverages › Coffee › Whole Coffee Beans",
      "coffee beans", "Whole Bean Coffee", ("whole bean coffee", "coffee beans"),
      ("medium roast", "dark roast", "fair trade", "single origin", "low acid", "usda organic"),
      {"flavor": ("original", "vanilla", "hazelnut", "caramel"), "size": ("12 oz", "2 lb", "5 lb")}, (9, 48),
       "Roasted in small batches and packed fresh.", plural=True),
    T("protein-bars", "grocery", "Grocery & Gourmet Food › Snack Foods › Bars › Protein Bars",
      "protein bars", "Protein Bars", ("protein bars",),
      ("gluten free", "low sugar", "high protein", "keto friendly", "non gmo", "plant based"),
      {"flavor": ("chocolate chip", "peanut butter", "cookie dough", "salted caramel", "blueberry"),
       "count": ("6 count", "12 count")}, (10, 40), "A filling snack for the gym bag.", plural=True),
    T("herbal-tea", "grocery", "Grocery & Gourmet Food › Beverages › Tea › Herbal Tea",
      "herbal tea", "Herbal Tea", ("herbal tea",),
      ("caffeine free", "usda organic", "non gmo", "kosher", "+individually wrapped bags"),
      {"flavor": ("chamomile", "peppermint", "ginger", "hibiscus", "lemon balm"), "count": ("20 bags", "100 bags")},
       (4, 25), "A calming cup for the evening.", ood=True),
    # electronics
    T("earbuds", "electronics", "Electronics › Headphones, Earbuds & Accessories › Earbuds & In-Ear Headphones",
      "wireless earbuds", "Wireless Earbuds", ("wireless earbuds", "bluetooth earbuds"),
      ("noise cancelling", "long battery life", "water resistant", "+charging case", "+built in microphone",
       "touch control"),
      {"color": ("black", "white", "blue", "pink")}, (19, 120),
       "Pairs in seconds and stays put on a run.", plural=True),
    T("phone-case", "electronics", "Cell Phones & Accessories › Cases, Holsters & Sleeves › Basic Cases",
      "phone case", "Phone Case", ("phone case",),
      ("shockproof", "+card holder", "+kickstand", "clear back", "drop protection", "+raised edges"),
      {"color": ("black", "clear", "purple", "green", "red"), "model": ("iphone", "galaxy", "pixel")}, (7, 30),
       "Slim protection that keeps the buttons easy to press."),
    T("usb-charger", "electronics", "Electronics › Accessories & Supplies › Power Accessories › Chargers",
      "usb c charger", "USB C Charger", ("usb c charger", "usb-c wall charger"),
      ("fast charging", "foldable plug", "dual port", "+overheat protection", "travel size"),
      {"power": ("20w", "45w", "100w"), "color": ("black", "white")}, (10, 55),
       "Charges a phone and a laptop from one outlet.", ood=True),
    # computers
    T("wireless-mouse", "computers", "Electronics › Computers & Accessories › Keyboards, Mice & Accessories › Mice",
      "wireless mouse", "Wireless Mouse", ("wireless mouse", "computer mouse"),
      ("silent click", "rechargeable battery", "+usb receiver", "bluetooth pairing", "adjustable dpi",
       "ergonomic shape"),
      {"color": ("black", "grey", "white", "pink", "blue")}, (9, 45), "Glides smoothly on most desks."),
    T("keyboard", "computers", "Electronics › Computers & Accessories › Keyboards, Mice & Accessories › Keyboards",
      "mechanical keyboard", "Mechanical Keyboard", ("mechanical keyboard",),
      ("rgb backlit", "hot swappable", "compact layout", "+usb c cable", "anti ghosting", "wireless mode"),
      {"switch": ("red switch", "blue switch", "brown switch"), "color": ("black", "white")}, (35, 140),
       "Crisp keys for typing and gaming."),
    T("laptop-backpack", "computers",
      "Electronics › Computers & Accessories › Laptop Accessories › Bags & Cases › Backpacks",
      "laptop backpack", "Laptop Backpack", ("laptop backpack",),
      ("water resistant", "+usb charging port", "anti theft", "padded compartment", "+luggage strap"),
      {"color": ("black", "grey", "navy", "green"), "size": ("regular", "large")}, (22, 80),
       "Carries a laptop and a day's worth of gear.", ood=True),
    # furniture
    T("office-chair", "furniture", "Home & Kitchen › Furniture › Home Office Furniture › Home Office Chairs",
      "office chair", "Office Chair", ("office chair", "desk chair"),
      ("lumbar support", "adjustable height", "mesh back", "swivel base", "+padded armrests", "high back"),
      {"color": ("black", "grey", "white", "blue")}, (60, 260), "Keeps you comfortable through long work days."),
    T("bookshelf", "furniture", "Home & Kitchen › Furniture › Living Room Furniture › Bookcases",
      "bookshelf", "Bookshelf", ("bookshelf", "bookcase"),
      ("solid wood", "easy assembly", "metal frame", "+open shelves", "+anti tip kit", "industrial style"),
      {"color": ("walnut", "white", "black", "espresso"), "tiers": ("3 tier", "5 tier")}, (45, 220),
       "Room for books, plants and photos."),
    T("bar-stools", "furniture", "Home & Kitchen › Furniture › Kitchen & Dining Room Furniture › Barstools",
      "bar stools", "Bar Stools", ("bar stools", "counter stools"),
      ("counter height", "swivel seat", "+footrest", "faux leather", "two pack", "+back rest"),
      {"color": ("black", "brown", "grey", "white")}, (70, 280),
       "Seating for the kitchen island.", plural=True, ood=True),
    # home
    T("bed-sheets", "home", "Home & Kitchen › Bedding › Sheets & Pillowcases › Sheet & Pillowcase Sets",
      "bed sheets", "Bed Sheet Set", ("bed sheets",),
      ("deep pocket", "microfiber", "egyptian cotton", "wrinkle resistant", "cooling", "machine washable"),
      {"color": ("white", "grey", "navy", "beige", "sage"), "size": ("twin", "full", "queen", "king")}, (20, 90),
       "Soft sheets that stay on the mattress.", plural=True),
    T("pillow-covers", "home",
      "Home & Kitchen › Home Décor › Decorative Pillows, Inserts & Covers › Throw Pillow Covers",
      "throw pillow covers", "Throw Pillow Covers", ("throw pillow covers", "pillow covers"),
      ("velvet", "+hidden zipper", "farmhouse style", "boho pattern", "linen look", "four pack"),
      {"color": ("mustard", "teal", "blush", "grey", "cream"), "size": ("18x18 inch", "20x20 inch")}, (10, 35),
       "An easy way to refresh a sofa.", plural=True),
    T("bath-towels", "home", "Home & Kitchen › Bath › Towels › Bath Towels",
      "bath towels", "Bath Towels", ("bath towels",),
      ("quick dry", "highly absorbent", "hotel quality", "ringspun cotton", "oeko tex certified"),
      {"color": ("white", "grey", "navy", "teal", "beige")}, (18, 65),
       "Plush towels for a spa feel at home.", plural=True),
    # kitchen
    T("water-bottle", "kitchen", "Home & Kitchen › Kitchen & Dining › Travel & To-Go Drinkware › Water Bottles",
      "water bottle", "Water Bottle", ("water bottle",),
      ("vacuum insulated", "bpa free", "leak proof", "stainless steel", "+straw lid", "dishwasher safe"),
      {"color": ("black", "white", "pink", "green", "purple"), "capacity": ("20 oz", "40 oz")}, (12, 45),
       "Keeps drinks cold all day."),
    T("chef-knife", "kitchen", "Home & Kitchen › Kitchen & Dining › Cutlery & Knife Accessories › Chef's Knives",
      "chef knife", "Chef Knife", ("chef knife", "kitchen knife"),
      ("high carbon", "+ergonomic handle", "razor sharp", "full tang", "+gift box", "+blade guard"),
      {"size": ("6 inch", "8 inch", "10 inch")}, (15, 90), "Slices, dices and minces with ease."),
    T("coffee-mug", "kitchen",
      "Home & Kitchen › Kitchen & Dining › Dining & Entertaining › Cups, Mugs & Saucers › Mugs",
      "coffee mug", "Coffee Mug", ("coffee mug",),
      ("ceramic", "microwave safe", "dishwasher safe", "+large handle", "gift ready"),
      {"color": ("white", "black", "sage", "navy", "coral"), "capacity": ("12 oz", "20 oz")}, (8, 28),
       "A sturdy mug for the morning brew."),
    # sports
    T("yoga-mat", "sports", "Sports & Outdoors › Exercise & Fitness › Yoga › Yoga Mats",
      "yoga mat", "Yoga Mat", ("yoga mat",),
      ("non slip", "extra thick", "+carrying strap", "+tpe material", "+alignment lines", "sweat resistant"),
      {"color": ("purple", "blue", "black", "pink", "green"), "thickness": ("6mm", "10mm")}, (15, 55),
       "Grippy cushioning for floor work."),
    T("dumbbells", "sports", "Sports & Outdoors › Exercise & Fitness › Strength Training Equipment › Dumbbells",
      "dumbbells", "Dumbbells", ("dumbbells",),
      ("neoprene coated", "hex shape", "anti roll", "+textured grip", "rubber encased"),
      {"weight": ("8 lb", "15 lb", "30 lb"), "color": ("black", "purple", "blue")}, (15, 90),
       "Home strength training without a gym.", plural=True),
    T("camping-tent", "sports", "Sports & Outdoors › Outdoor Recreation › Camping & Hiking › Tents",
      "camping tent", "Camping Tent", ("camping tent", "tent"),
      ("waterproof", "easy setup", "+rainfly", "+mesh windows", "+carry bag"),
      {"capacity": ("two person", "four person", "six person"), "color": ("green", "orange", "grey")}, (40, 200),
       "A roomy shelter for weekend trips.", ood=True),
    # pets
    T("dog-bed", "pets", "Pet Supplies › Dogs › Beds & Furniture › Beds",
      "dog bed", "Dog Bed", ("dog bed",),
      ("orthopedic", "memory foam", "+washable cover", "non slip bottom", "raised rim", "calming"),
      {"color": ("grey", "brown", "beige", "navy"), "size": ("small", "medium", "large", "xl")}, (20, 95),
       "A cozy spot for naps."),
    T("cat-litter", "pets", "Pet Supplies › Cats › Litter & Housebreaking › Litter",
      "cat litter", "Cat Litter", ("cat litter",),
      ("clumping", "unscented", "low dust", "odor control", "flushable", "extra strength"),
      {}, (10, 35), "Easy scooping and a fresh litter box."),
    T("dog-collar", "pets", "Pet Supplies › Dogs › Collars, Harnesses & Leashes › Collars",
      "dog collar", "Dog Collar", ("dog collar",),
      ("reflective", "quick release buckle", "padded", "heavy duty", "+name tag"),
      {"color": ("red", "black", "blue", "pink", "orange"), "size": ("small", "medium", "large")}, (7, 28),
       "A comfortable collar for daily walks.", ood=True),
    # office
    T("gel-pens", "office", "Office Products › Office & School Supplies › Writing Supplies › Pens › Gel Pens",
      "gel pens", "Gel Pens", ("gel pens",),
      ("fine point", "retractable", "+quick drying ink", "smooth writing", "+comfort grip"),
      {"ink": ("black", "blue", "red", "assorted"), "count": ("12 pack", "36 pack")}, (6, 25),
       "Bold lines without smudges.", plural=True),
    T("notebook", "office", "Office Products › Office & School Supplies › Paper › Notebooks & Writing Pads",
      "notebook", "Notebook", ("notebook",),
      ("college ruled", "hardcover", "+dotted pages", "+elastic closure", "+back pocket", "thick paper"),
      {"color": ("black", "navy", "green", "burgundy"), "size": ("a5", "b5")}, (6, 26),
       "For notes, lists and sketches."),
    T("desk-organizer", "office", "Office Products › Office & School Supplies › Desk Accessories › Desk Organizers",
      "desk organizer", "Desk Organizer", ("desk organizer",),
      ("mesh metal", "+pen holder", "+drawer", "bamboo wood", "space saving"),
      {"color": ("black", "white", "walnut")}, (12, 45), "Keeps pens and papers in one place."),
)

BRAND_HEADS = ("Vel", "Nor", "Kal", "Bri", "Lum", "Ast", "Cor", "Mir", "Tal", "Zen", "Ori", "Sol", "Dax", "Pel", "Rho",
               "Quin")
BRAND_TAILS = ("ora", "ix", "en", "ava", "is", "ent", "ara", "o", "ine", "ex", "um", "ada")
ACRONYMS = {"bpa": "BPA", "usb": "USB", "rgb": "RGB", "dpi": "DPI", "gmo": "GMO", "tpe": "TPE", "usda": "USDA",
            "oeko": "OEKO"}
FEATURE_NOTES = ("as described", "for everyday use", "checked by our team", "a customer favorite", "built to last")
TEMPLATES = ("i need {a}{adj}{say}{with}{opts}", "i am looking for {a}{adj}{say}{with}{opts}",
             "i'm looking for {a}{adj}{say}{with}{opts}", "i want {a}{adj}{say}{with}{opts}",
             "find me {a}{adj}{say}{with}{opts}", "i would like {a}{adj}{say}{with}{opts}",
             "show me {a}{adj}{say}{with}{opts}", "i want to buy {a}{adj}{say}{with}{opts}")
OPTION_PHRASES = {
    "color": (" in {v}", " in {v} color", ", {v} color", ", pick the {v} one"),
    "size": (", size {v}", " in size {v}", ", {v} size"),
    "flavor": (", {v} flavor", " in {v} flavor"),
    "scent": (", {v} scent", " with {v} scent"),
    "ink": (", {v} ink",),
    "model": (" for {v}", " for the {v}"),
    "capacity": (", {v}", ", {v} capacity"),
}


def _cap(phrase: str) -> str:
    return " ".join(ACRONYMS.get(w, w.capitalize()) for w in phrase.split())


def _attrs(ptype: ProductType) -> list:
    return [a.lstrip("+") for a in ptype.attrs]


def _make_product(ptype: ProductType, rng: random.Random, brand: str, asin: str) -> dict:
    attrs = rng.sample(_attrs(ptype), rng.randint(3, 4))
    # title: brand, one attribute, the type noun, sometimes a second attribute (short on purpose)
    title = f"{brand} {_cap(attrs[0])} {ptype.noun}"
    if rng.random() < 0.5:
        title += f", {_cap(attrs[1])}"
    options = {}
    for group, values in ptype.options.items():
        keep = sorted(rng.sample(range(len(values)), rng.randint(2, len(values))))
        options[group] = [values[i] for i in keep]
    price = round(rng.uniform(*ptype.price)) - 0.01
    bullets = [f"{_cap(a)}: {rng.choice(FEATURE_NOTES)}." for a in attrs]
    description = f"{ptype.blurb} {brand} {ptype.noun.lower()}: {', '.join(attrs)}."
    return {"asin": asin, "name": title, "Title": title, "category": ptype.category, "query": ptype.query,
            "product_category": ptype.path, "Price": f"${price:.2f}", "pricing": [price], "options": options,
            "Attributes": attrs, "BulletPoints": bullets, "Description": description,
            "Rating": f"{rng.uniform(3.4, 5.0):.1f}", "Reviews": []}


def price_limit(price: float, rng: random.Random) -> float | None:
    """WebShop's rule: the larger of two of the first four multiples of 10 above the price."""
    above = [p for p in PRICE_RANGE if p > price][:4]
    if len(above) < 2:
        return None
    return sorted(rng.sample(above, 2))[1]


def _make_goal(ptype: ProductType, product: dict, rng: random.Random) -> dict:
    plus = {a.lstrip("+") for a in ptype.attrs if a.startswith("+")}
    attrs = rng.sample(product["Attributes"], rng.choice((1, 1, 2, 2, 3)))
    adj = [a for a in attrs if a not in plus]
    noun_like = [a for a in attrs if a in plus]
    groups = list(product["options"])
    chosen = [g for g in groups if rng.random() < 0.8]   # some goals leave an option group open
    goal_options = [rng.choice(product["options"][g]) for g in chosen]
    opts = "".join(rng.choice(OPTION_PHRASES.get(g, (", {v}",))).format(v=v) for g, v in zip(chosen, goal_options))

    say = rng.choice(ptype.say)
    if len(adj) > 1 and rng.random() < 0.5:
        adj_text = ", ".join(adj[:-1]) + " and " + adj[-1] + " "
    else:
        adj_text = ", ".join(adj) + " " if adj else ""
    first = (adj_text or say)[0]
    article = "" if ptype.plural else ("an " if first in "aeiou" else "a ")
    with_text = (" with " + " and ".join(noun_like)) if noun_like else ""
    text = rng.choice(TEMPLATES).format(a=article, adj=adj_text, say=say, opts=opts, **{"with": with_text})
    price_upper = price_limit(product["pricing"][0], rng)
    if price_upper is None:
        price_upper = 1000000.0
    else:
        text += f", and price lower than {price_upper:.2f} dollars"
    return {"asin": product["asin"], "category": product["category"], "query": product["query"],
            "name": product["name"], "product_category": product["product_category"], "instruction_text": text,
            "attributes": attrs, "price_upper": price_upper, "goal_options": goal_options, "weight": 1}


def _asin(rng: random.Random, taken: set) -> str:
    while True:
        asin = "B0" + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(8))
        if asin not in taken:
            taken.add(asin)
            return asin


def generate_catalog(seed: int = CATALOG_SEED) -> tuple:
    """(products, {split: [goal, ...]}) for the shipped catalog; same seed, same catalog."""
    rng = random.Random(seed)
    brands = [h + t for h in BRAND_HEADS for t in BRAND_TAILS]
    products, splits, taken, texts = [], {"train": [], "val": [], "test": [], "ood": []}, set(), set()
    for ptype in PRODUCT_TYPES:
        made = [_make_product(ptype, rng, rng.choice(brands), _asin(rng, taken)) for _ in range(PRODUCTS_PER_TYPE)]
        products += made
        n_test = round(len(made) * TEST_SHARE)
        for i, product in enumerate(made):
            split = ("ood" if ptype.ood else "test" if i < n_test
                     else "val" if (i - n_test) % VAL_EVERY == 0 else "train")   # the split takes no rng draw
            for _ in range(GOALS_PER_PRODUCT):
                for _attempt in range(20):   # every instruction text is unique across all splits
                    goal = _make_goal(ptype, product, rng)
                    if goal["instruction_text"] not in texts:
                        texts.add(goal["instruction_text"])
                        splits[split].append(goal)
                        break
    return products, splits


# --- WebShop's own files ------------------------------------------------------------------
PRODUCT_FILES = ("items_shuffle_1000.json", "items_shuffle.json")
HUMAN_GOAL_FILE = "items_human_ins.json"
ATTRIBUTE_FILES = ("items_ins_v2_1000.json", "items_ins_v2.json")
_STATED_PRICE = re.compile(r"price lower than (\d+(?:\.\d+)?) dollars")


def _first_existing(data_dir: str, names: tuple) -> str | None:
    for name in names:
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    return None


def _process_product(p: dict, attributes: dict) -> dict:
    """One raw WebShop product in the shape engine.load_products gives it."""
    asin = p["asin"]
    raw_price = p.get("pricing")
    if not raw_price:
        pricing, price_tag = [100.0], "$100.0"
    else:
        pricing = [float(Decimal(re.sub(r"[^\d.]", "", part))) for part in raw_price.split("$")[1:]]
        price_tag = f"${pricing[0]}" if len(pricing) == 1 else f"${pricing[0]} to ${pricing[1]}"
        pricing = pricing[:2]
    options = {}
    for group, contents in (p.get("customization_options") or {}).items():
        if contents is None:          # e.g. {"Color": null}
            continue
        options[group.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
    bullets = p.get("small_description", [])
    attrs = attributes.get(asin, {}).get("attributes")
    return {"asin": asin, "name": p["name"], "Title": p["name"], "category": p["category"],
            "query": p["query"].lower().strip(), "product_category": p["product_category"],
            "Price": price_tag, "pricing": pricing, "options": options,
            "Attributes": attrs if attrs else ["DUMMY_ATTR"],   # WebShop's placeholder without items_ins_v2
            "BulletPoints": bullets if isinstance(bullets, list) else [bullets],
            "Description": p.get("full_description") or "", "Rating": "N.A.", "Reviews": []}


def load_webshop_dir(data_dir: str, seed: int = 0) -> tuple:
    """(products, prices {asin: float}, goals) from WebShop's data files in data_dir.

    Differences from WebShop: prices of price ranges and goal price limits are drawn from a
    seeded generator (WebShop's are unseeded), and an instruction that already states
    "price lower than X dollars" keeps X as its limit instead of getting a second one.
    """
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"webshop-mini data_dir {data_dir!r} does not exist")
    product_path = _first_existing(data_dir, PRODUCT_FILES)
    goal_path = _first_existing(data_dir, (HUMAN_GOAL_FILE,))
    missing = ([" or ".join(PRODUCT_FILES)] if product_path is None else []) + \
              ([HUMAN_GOAL_FILE] if goal_path is None else [])
    if missing:
        raise FileNotFoundError(f"webshop-mini data_dir {data_dir!r} lacks {', '.join(missing)}")
    attr_path = _first_existing(data_dir, ATTRIBUTE_FILES)
    with open(product_path) as f:
        raw = json.load(f)
    with open(goal_path) as f:
        human = json.load(f)
    attributes = {}
    if attr_path:
        with open(attr_path) as f:
            attributes = json.load(f)

    rng = random.Random(seed)
    products, seen = [], set()
    for p in raw:
        asin = str(p.get("asin", ""))
        if asin == "nan" or len(asin) > 10 or asin in seen:   # WebShop skips these
            continue
        seen.add(asin)
        products.append(_process_product(p, attributes))
    prices = {}
    for p in products:
        lo_hi = p["pricing"]
        prices[p["asin"]] = lo_hi[0] if len(lo_hi) == 1 else rng.uniform(*lo_hi[:2])

    goals = []
    for p in products:
        for ins in human.get(p["asin"], []):
            if not ins.get("instruction_attributes"):   # WebShop skips goals without attributes
                continue
            text = ins["instruction"].strip(".")
            stated = _STATED_PRICE.search(text)
            if stated:
                price_upper = float(stated.group(1))
            else:
                price_upper = price_limit(prices[p["asin"]], rng)
                if price_upper is None:
                    price_upper = 1000000.0
                else:
                    text += f", and price lower than {price_upper:.2f} dollars"
            goals.append({"asin": p["asin"], "category": p["category"], "query": p["query"], "name": p["name"],
                          "product_category": p["product_category"], "instruction_text": text,
                          "attributes": ins["instruction_attributes"], "price_upper": price_upper,
                          "goal_options": ins.get("instruction_options", []), "weight": 1})
    return products, prices, goals
