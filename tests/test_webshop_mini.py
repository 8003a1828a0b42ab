"""webshop-mini: WebShop's reward, pages, search, splits, the real-data loader and bad input."""
import hashlib
import os
import random
import shutil
from math import isclose

import pytest

import envs
from envs import webshop_catalog as catalog_mod
from envs.webshop_mini import SEARCH_FORM, get_catalog, oracle_actions
from envs.webshop_reward import (get_attribute_reward, get_option_reward, get_reward, get_type_reward,
                                 normalize_color, title_nouns)

REAL = os.path.join(os.path.dirname(__file__), "data", "webshop_real_sample")


def run(env, actions):
    out = None
    for a in actions:
        out = env.step(a)
        assert out[3]["valid"], (a, out[0])
    return out


# --- reward: WebShop's own test cases (tests/web-agent-site/engine/test_goal.py) --------------
def test_type_reward_webshop_cases():
    goal = {"query": "Query 1", "product_category": "a › b › c", "name": "Name 1"}
    bought = dict(goal)
    r = get_type_reward(bought, goal)
    assert (r["r_type"], r["query_match"], r["category_match"], r["title_score"]) == (1.0, True, True, 1)
    bought["query"] = "Query 2"
    assert get_type_reward(bought, goal)["query_match"] is False
    # category levels are compared as sets: >= 2 shared levels, order and repeats ignored
    for path, match in [("b › c › a", True), ("d › e › f", False), ("a › d › b", True), ("a › a › b", True),
                        ("a › a › d", False)]:
        bought["product_category"] = path
        assert get_type_reward(bought, goal)["category_match"] is match, path
    cases = [("adidas Unisex-Adult D.o.n. Issue 2 Basketball Shoe",
              "adidas Unisex-Adult D.o.n. Issue 2 Indoor Court Shoe", 0.85),
             ("Saireed UL Listed 2 Prong Power Cord for JBL Bar 3.1 Bar 2.1 Channel 4K Ultra HD Soundbar Home Theater "
              "System Subwoofer", "BRST AC Power Cord Outlet Socket Cable Plug Lead for Panasonic SC-HT830V DVD/VCR "
              "Combo Home Theater System", 0.31),
             ("Saireed UL Listed 2 Prong Power Cord for JBL Bar 3.1 Bar 2.1 Channel 4K Ultra HD Soundbar",
              "BRST AC Power Cord Outlet Socket Cable Plug Lead for Panasonic SC-HT830V DVD/VCR Combo Home Theater "
              "System", 0.17)]
    for want, got, score in cases:
        goal["name"], bought["name"] = want, got
        assert isclose(get_type_reward(bought, goal)["title_score"], score, abs_tol=1e-2)
    goal["name"] = "Rusticware 921ORB Kitchen and Bath Cabinet Knob"
    bought["name"] = "Minkissy 2pcs Stainless Steel Eyebrow Tweezers Blackhead Acne Remover Portable Makeup Tweezers (Silver)"
    assert get_type_reward(bought, goal)["title_score"] < 0.05


def test_attribute_reward_webshop_cases():
    goal = {"attributes": ["tea tree", "essential oils", "natural ingredients"]}
    # exact (fuzzy: "essential oil" ~ "essential oils"); text fields are not needed when all match
    assert get_attribute_reward({"Attributes": ["tea tree", "essential oil", "natural ingredients"]}, goal) == (1, 3)
    empty_text = {"Title": "", "BulletPoints": [], "Description": ""}
    r, n = get_attribute_reward({"Attributes": ["essential oil", "natural ingredients"], **empty_text}, goal)
    assert (r, n) == (2 / 3, 2)
    r, n = get_attribute_reward({"Attributes": [], "Title": "",
                                 "BulletPoints": ["This shampoo has essential oils and smells like lemons"],
                                 "Description": "Best shampoo on the market, made with natural ingredients"}, goal)
    assert (r, n) == (2 / 3, 2)
    r, n = get_attribute_reward({"Attributes": ["tea bag", "earl gray", "lipton"], "Title": "English tea for breakfast",
                                 "BulletPoints": ["Soothing aroma", "Calming, great feeling"],
                                 "Description": "Best tea made by Lipton, great to pair with breakfast"}, goal)
    assert (r, n) == (0, 0)


def test_option_reward_webshop_cases():
    goal = ["grey", "XL", "pack of 12"]
    assert get_option_reward(["pack of 12", "grey", "XL"], goal) == (1, 3)
    assert get_option_reward(["pack of 12", "blue", "XL"], goal) == (2 / 3, 2)
    assert get_option_reward(["pack of 12", "powder snow", "XL"], ["cool powder snow", "XL", "pack of 12"]) == (1, 3)
    assert get_option_reward(["goal 1", "goal 2"], []) == (None, 0)
    assert get_option_reward([], ["goal 1", "goal 2"]) == (0, 0)


def test_total_reward_webshop_cases():
    name = "Mens D.O.N. Issue 2 Gca Basketball Sneakers Shoes Casual - Off White"
    goal = {"query": "Query 1", "product_category": "a › b › c", "name": name,
            "attributes": ["tea tree", "essential oils", "natural ingredients"],
            "goal_options": {"color": "grey", "size": "XL"}, "price_upper": 40.00}
    bought = {"query": "Query 1", "product_category": "a › b › c", "name": name,
              "Attributes": ["tea tree", "essential oil", "natural ingredients"], "Title": "", "BulletPoints": [],
              "Description": ""}
    options = {"color": "grey", "size": "XL"}
    assert get_reward(bought, goal, 35, options) == 1
    bought.update(Attributes=[], BulletPoints="This shampoo has essential oils and smells like lemons",
                  Description="Best shampoo on the market, made with natural ingredients")
    assert isclose(get_reward(bought, goal, 35, options), 2 / 3, abs_tol=1e-2)
    goal["goal_options"] = {"color": "grey", "size": "XL", "amount": "pack of 12"}
    assert isclose(get_reward(bought, goal, 35, options), 0.5714, abs_tol=1e-2)
    goal["name"] = "Saireed UL Listed 2 Prong Power Cord for JBL Bar 3.1 Bar 2.1 Channel 4K Ultra HD Soundbar"
    bought.update(name="BRST AC Power Cord Outlet Socket Cable Plug Lead for Panasonic SC-HT830V DVD/VCR Combo Home "
                       "Theater System", query="Query 2", product_category="a › d › e")
    assert isclose(get_reward(bought, goal, 35, options), 0.2857, abs_tol=1e-2)


def test_normalize_color_and_nouns():
    for text, want in [("", ""), ("black forest", "black"), ("violet lavender", "lavender"),
                       ("steelivy fuchsia", "fuchsia"), ("123alabaster", "alabaster"), ("webshop", "webshop")]:
        assert normalize_color(text) == want
    # numbers, stop words and title adjectives are not nouns; repeated nouns are kept
    assert title_nouns("Premium 2 Pack Red Bar for the Bar") == ["pack", "red", "bar", "bar"]


# --- reward: hand-worked cases on our own product format ------------------------------------
def _product(**kw):
    p = {"query": "lipstick", "product_category": "Beauty › Makeup › Lips", "name": "Velora Matte Lipstick",
         "Title": "Velora Matte Lipstick", "Attributes": ["long lasting", "vegan"], "BulletPoints": [],
         "Description": ""}
    p.update(kw)
    return p


GOAL = {"query": "lipstick", "product_category": "Beauty › Makeup › Lips", "name": "Velora Matte Lipstick",
        "attributes": ["long lasting", "vegan"], "goal_options": ["red"], "price_upper": 30.0}


def test_reward_partial_price_and_type():
    assert get_reward(_product(), GOAL, 20.0, {"color": "red"}) == 1.0
    assert get_reward(_product(), GOAL, 20.0, {"color": "redwood"}) == 1.0      # colour normalised
    assert get_reward(_product(), GOAL, 20.0, {"color": "pink"}) == 3 / 4       # wrong option
    assert get_reward(_product(), GOAL, 20.0, {}) == 3 / 4                      # option never clicked
    assert get_reward(_product(), GOAL, 35.0, {"color": "red"}) == 3 / 4        # price over the limit
    assert get_reward(_product(Attributes=["vegan"]), GOAL, 20.0, {"color": "red"}) == 3 / 4
    # another kind of product: no shared query, category level or title noun -> r_type 0
    other = _product(query="dog bed", product_category="Pets › Dogs", name="Kalix Orthopedic Dog Bed")
    total, info = get_reward(other, GOAL, 20.0, {"color": "red"}, verbose=True)
    assert total == 0.0 and info["r_type"] == 0.0 and info["title_score"] == 0.0
    # same category path but different query and few shared nouns: r_type 0.5
    near = _product(query="lip gloss", name="Velora Lip Gloss Set Mirror Case")
    assert get_type_reward(near, {**GOAL, "name": "Velora Matte Lipstick Tube Pack Box"})["r_type"] == 1.0
    near2 = _product(query="lip gloss", product_category="Other › Things", name="Velora Gloss Set Mirror Case Kit")
    r = get_type_reward(near2, {**GOAL, "name": "Velora Lipstick Tube Pack Box Gift"})
    assert isclose(r["title_score"], 1 / 6) and r["r_type"] == 0.5


def test_reward_goal_without_options_or_attributes():
    no_opts = {**GOAL, "goal_options": []}
    assert get_reward(_product(), no_opts, 20.0, {"color": "pink"}) == 1.0
    total, info = get_reward(_product(), {**GOAL, "attributes": []}, 20.0, {"color": "red"}, verbose=True)
    assert total == 1.0 and info["r_att"] is None


# --- the shipped catalog --------------------------------------------------------------------
def test_catalog_size_fields_and_determinism():
    products, splits = catalog_mod.generate_catalog()
    assert len(products) >= 1000 and len({p["category"] for p in products}) >= 10
    assert sum(len(g) for g in splits.values()) >= 2000
    for p in products:
        assert " › " in p["product_category"] and p["query"] and p["Title"] and p["BulletPoints"]
        assert p["Description"] and p["Attributes"] and isinstance(p["options"], dict) and p["pricing"][0] > 0
    for g in splits["train"][:200]:   # the instruction states everything the reward checks
        text = g["instruction_text"]
        assert text == text.lower() and text.endswith(f", and price lower than {g['price_upper']:.2f} dollars")
        assert all(a in text for a in g["attributes"]) and all(o in text for o in g["goal_options"])
        assert g["weight"] == 1 and g["asin"] in {p["asin"] for p in products}
    again = catalog_mod.generate_catalog()
    assert again == (products, splits)
    assert catalog_mod.generate_catalog(seed=1)[0] != products


def test_catalog_options_and_attributes_are_unambiguous():
    """Within a product type, no option value or attribute gives credit for another one, and a
    product's text never mentions an attribute it lacks: otherwise wrong purchases score 1."""
    products, _ = catalog_mod.generate_catalog()
    for ptype in catalog_mod.PRODUCT_TYPES:
        values = [v for vs in ptype.options.values() for v in vs]
        assert len(set(values)) == len(values), ptype.key
        for group in ptype.options.values():
            for i, a in enumerate(group):
                assert all(get_option_reward([a], [b])[1] == 0 for b in group[i + 1:]), (ptype.key, a)
        pool = [a.lstrip("+") for a in ptype.attrs]
        for p in (p for p in products if p["query"] == ptype.query):
            for a in pool:
                assert get_attribute_reward(p, {"attributes": [a]})[1] == (a in p["Attributes"]), (p["Title"], a)


def test_splits_are_disjoint():
    by = {s: envs.tasks("webshop-mini", s) for s in ("train", "test", "ood", "all")}
    cat = get_catalog()
    goals = {s: [cat.goals[t.goal_index] for t in ts] for s, ts in by.items()}
    texts = {s: {g["instruction_text"] for g in gs} for s, gs in goals.items()}
    asins = {s: {g["asin"] for g in gs} for s, gs in goals.items()}
    queries = {s: {g["query"] for g in gs} for s, gs in goals.items()}
    assert not texts["train"] & texts["test"] and not texts["train"] & texts["ood"]
    assert not asins["train"] & asins["test"]          # test targets are unseen products
    assert queries["test"] <= queries["train"]          # ... of seen product types
    assert not queries["ood"] & queries["train"]        # ood: product types never seen in train
    assert len(by["all"]) == len(by["train"]) + len(envs.tasks("webshop-mini", "val")) + len(by["test"]) + len(by["ood"])
    ids = [t.task_id for t in by["all"]]
    assert len(set(ids)) == len(ids) and by["test"][123].task_id == "webshop-mini/test/123"
    assert all(t.instruction == cat.goals[t.goal_index]["instruction_text"] for t in by["all"])
    assert envs.tasks("webshop-mini", "test") == by["test"]   # fixed order


def _digest(tasks) -> str:
    return hashlib.sha256(repr([(t.task_id, t.goal_index, t.instruction) for t in tasks]).encode()).hexdigest()[:16]


def test_val_split_is_new_products_of_known_types_taken_from_train():
    by = {s: envs.tasks("webshop-mini", s) for s in ("train", "val", "test", "ood", "all")}
    cat = get_catalog()
    assert {s: len(ts) for s, ts in by.items()} == {"train": 1344, "val": 168, "test": 504, "ood": 648, "all": 2664}
    # test and ood are what they were before val existed (earlier results used them)
    assert (_digest(by["test"]), _digest(by["ood"])) == ("80ba9bc440f9d902", "20ee0f195e599ed6")
    val = by["val"]
    assert all(t.task_id == f"webshop-mini/val/{k}" and t.split == "val" for k, t in enumerate(val))
    field = lambda ts, key: {cat.goals[t.goal_index][key] for t in ts}  # noqa: E731
    for other in ("train", "test", "ood"):
        assert not {t.task_id for t in val} & {t.task_id for t in by[other]}, other
        assert not {t.goal_index for t in val} & {t.goal_index for t in by[other]}, other
        assert not {t.instruction for t in val} & {t.instruction for t in by[other]}, other
        assert not field(val, "asin") & field(by[other], "asin"), other     # val targets are unseen products
    assert field(val, "query") == field(by["train"], "query")               # ... of every type train has
    # val was carved out of the old train split: together they hold its 1,512 goals, indices 0-1511
    assert sorted(t.goal_index for t in by["train"] + val) == list(range(1512))
    assert [t.goal_index for t in by["all"]] == sorted(t.goal_index for s in ("train", "val", "test", "ood") for t in by[s])
    assert envs.tasks("webshop-mini", "val") == val                     # deterministic
    assert catalog_mod.generate_catalog()[1]["val"] == [cat.goals[t.goal_index] for t in val]
    env = envs.make("webshop-mini", "val", seed=0)
    assert env.reset()[1]["task_id"].startswith("webshop-mini/val/")   # a goal drawn from val


# --- the oracle -----------------------------------------------------------------------------
@pytest.mark.parametrize("split,minimum", [("val", 0.95), ("test", 0.95), ("ood", 0.95)])
def test_oracle_wins(split, minimum):
    env = envs.make("webshop-mini", split)
    won = []
    for task in envs.tasks("webshop-mini", split):
        env.reset(task)
        _, reward, done, info = run(env, oracle_actions(env))
        assert done and info["score"] == reward
        won.append(info["won"])
    assert sum(won) / len(won) >= minimum


def test_naive_policy_is_not_enough():
    """Buying the first hit for the product type, without options, rarely earns 1.0: the reward
    depends on attributes, options and price, and the catalog has same-type look-alikes."""
    env = envs.make("webshop-mini", "test")
    rewards = []
    for task in envs.tasks("webshop-mini", "test")[::4]:
        env.reset(task)
        _, _, _, info = run(env, [f"search[{env.goal['query']}]"])
        first = next(a for a in info["admissible_actions"] if a.startswith("click[b0"))
        rewards.append(run(env, [first, "click[buy now]"])[1])
    assert 0.2 < sum(rewards) / len(rewards) < 0.8 and sum(r == 1.0 for r in rewards) / len(rewards) < 0.2


def test_product_and_goal_without_options():
    env = envs.make("webshop-mini", "train")
    task = next(t for t in envs.tasks("webshop-mini", "train") if get_catalog().goals[t.goal_index]["query"] == "cat litter")
    env.reset(task)
    assert env.goal["goal_options"] == [] and get_catalog().by_asin[env.goal["asin"]]["options"] == {}
    _, reward, done, _ = run(env, oracle_actions(env))
    assert reward == 1.0 and done


# --- pages and actions ----------------------------------------------------------------------
def test_pages_navigation_and_reward_only_at_purchase():
    env = envs.make("webshop-mini", "test")
    task = envs.tasks("webshop-mini", "test")[0]
    obs, info = env.reset(task)
    assert obs.startswith("Instruction: " + task.instruction) and info["admissible_actions"] == [SEARCH_FORM]
    obs, r, done, info = run(env, ["search[Black White Grey  red]"])
    assert "Page 1 (Total results: 50)" in obs and r == 0 and not done
    asins = [a for a in info["admissible_actions"] if a.startswith("click[b0")]
    assert len(asins) == 10 and "click[next >]" in info["admissible_actions"]
    assert "click[< prev]" not in info["admissible_actions"]
    obs, *_, info = run(env, ["click[next >]"])
    assert "Page 2 (Total results: 50)" in obs and "click[< prev]" in info["admissible_actions"]
    assert not set(asins) & set(info["admissible_actions"])
    for _ in range(3):
        obs, *_, info = run(env, ["click[Next >]"])
    assert "Page 5" in obs and "click[next >]" not in info["admissible_actions"]
    first = next(a for a in info["admissible_actions"] if a.startswith("click[b0"))
    obs, r, _, info = run(env, [first])
    product = get_catalog().by_asin[first[6:-1].upper()]
    assert product["Title"] in obs and "[Buy Now]" in obs and r == 0
    for values in product["options"].values():
        assert all(f"click[{v}]" in info["admissible_actions"] for v in values)
    obs, *_ = run(env, ["click[features]"])
    assert product["BulletPoints"][0] in obs
    obs, *_ = run(env, ["click[< prev]", "click[description]"])
    assert product["Description"] in obs
    obs, *_, info = run(env, ["click[< prev]", "click[< prev]"])
    assert "Page 5" in obs and info["page"] == "results"
    obs, r, done, info = run(env, ["click[back to search]"])
    assert info["admissible_actions"] == [SEARCH_FORM] and info["score"] == 0.0 and not done
    obs, *_, info = run(env, ["Search [ Black White ]", "click [ Back to Search ]"])   # loose spacing and case
    # reset() without a task draws a goal of the env's split
    _, info = env.reset()
    assert info["task_id"].startswith("webshop-mini/test/") and env.goal["instruction_text"] == info["instruction"]


def test_every_admissible_action_is_accepted():
    env = envs.make("webshop-mini", "train", seed=3)
    rng = random.Random(3)
    for task in envs.tasks("webshop-mini", "train")[:40]:
        _, info = env.reset(task)
        done = False
        while not done:
            acts = info["admissible_actions"]
            act = "search[" + env.goal["query"] + "]" if acts == [SEARCH_FORM] else rng.choice(acts)
            _, reward, done, info = env.step(act)
            assert info["valid"], act
            assert reward == 0.0 or act == "click[buy now]"


def test_garbage_actions_never_raise():
    env = envs.make("webshop-mini", "test", max_steps=100)
    env.reset(envs.tasks("webshop-mini", "test")[5])
    noise = "".join(random.Random(0).choice("ab[]c ]d[\n\t{}") for _ in range(10_000))
    garbage = ["", "   ", "click[", "click[]", "click[buy now]", "search[]", "search[   ]", "search red shoes",
               "[search] shoes", "click[nonexistent button]", "cl1ck[back to search]", "\u00e9\u00e8\u4e2d\u6587 \U0001f600",
               noise, "search]red[", "\x00\x01", None, 42]
    for steps, action in enumerate(garbage, start=1):
        obs, reward, done, info = env.step(action)
        assert obs.startswith("Invalid action") and SEARCH_FORM in obs, action
        assert (info["valid"], reward, done, env.steps) == (False, 0.0, False, steps)
    assert len(obs) < 600                      # long input is cut in the message
    obs, *_, info = env.step("search[[[]]")      # a real search that matches nothing
    assert info["valid"] and "(Total results: 0)" in obs and info["admissible_actions"] == ["click[back to search]"]
    env.step("click[back to search]")
    obs, *_, info = env.step("search[red lipstick]")
    assert info["valid"]
    for action in ["search[red lipstick]", "click[b0000000000]", "click[< prev]", "click[buy now]"]:
        obs, reward, done, info = env.step(action)  # a search box exists only on the search page
        assert not info["valid"] and reward == 0 and "click[back to search]" in obs


def test_step_limit():
    env = envs.make("webshop-mini", "test")
    assert env.max_steps == 15
    env.reset(envs.tasks("webshop-mini", "test")[0])
    dones = [env.step("nonsense")[2] for _ in range(15)]
    assert dones == [False] * 14 + [True]
    obs, reward, done, info = env.step("click[buy now]")   # after the end: still no exception
    assert done and reward == 0 and not info["valid"]
    short = envs.make("webshop-mini", "test", max_steps=3)
    short.reset(envs.tasks("webshop-mini", "test")[0])
    assert [short.step("x")[2] for _ in range(3)] == [False, False, True]


def test_bad_arguments():
    with pytest.raises(ValueError, match="ood"):
        envs.tasks("webshop-mini", "validation")
    with pytest.raises(ValueError, match="unknown split"):
        envs.make("webshop-mini", "nope")
    with pytest.raises(TypeError):
        envs.make("webshop-mini", "train", colour="red")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        envs.make("webshop-mini", data_dir="/nonexistent/webshop")
    with pytest.raises(FileNotFoundError, match="items_human_ins.json"):
        envs.make("webshop-mini", data_dir=os.path.dirname(__file__))
    with pytest.raises(ValueError, match="valid: train, val, test, all"):
        envs.tasks("webshop-mini", "ood", data_dir=REAL)
    env = envs.make("webshop-mini", "test")
    with pytest.raises(ValueError, match="data source"):
        env.reset(envs.tasks("webshop-mini", "all", data_dir=REAL)[0])


# --- real WebShop data ----------------------------------------------------------------------
def test_real_sample_loads_like_webshop():
    products, prices, goals = catalog_mod.load_webshop_dir(REAL)
    by = {p["asin"]: p for p in products}
    assert len(products) == 20 and len(goals) == 16
    raw_none = [p for p in products if p["Price"] == "$100.0"]
    assert raw_none and all(p["pricing"] == [100.0] and prices[p["asin"]] == 100.0 for p in raw_none)
    dress = by["B08ZRR3DZT"]                      # "$19.99$27.99": a range, price drawn inside it
    assert dress["pricing"] == [19.99, 27.99] and dress["Price"] == "$19.99 to $27.99"
    assert 19.99 <= prices["B08ZRR3DZT"] <= 27.99
    assert dress["options"]["size"][:2] == ["x-small", "small"] and "light blue" in dress["options"]["color"]
    assert by["B06Y3VLDFB"]["options"] == {}      # customization_options ""
    assert by["B09DG92LJL"]["options"] == {}      # {"Color": null}
    assert all(p["Attributes"] == ["DUMMY_ATTR"] for p in products)   # no items_ins_v2 file
    assert all(p["query"] == p["query"].lower().strip() for p in products)
    shampoo = next(g for g in goals if g["asin"] == "B07B6DVG41")
    assert shampoo["price_upper"] == 40.0 and shampoo["instruction_text"].count("price lower than") == 1
    added = next(g for g in goals if g["asin"] == "B06Y3VLDFB")   # no stated price: WebShop appends one
    assert added["instruction_text"].endswith(f", and price lower than {added['price_upper']:.2f} dollars")
    assert added["price_upper"] > prices["B06Y3VLDFB"]


def test_real_sample_oracle_buys_every_goal():
    tasks = envs.tasks("webshop-mini", "all", data_dir=REAL)
    assert len(tasks) == 16 and tasks[0].task_id == "webshop-mini/real/0"
    test, train = envs.tasks("webshop-mini", "test", data_dir=REAL), envs.tasks("webshop-mini", "train", data_dir=REAL)
    val = envs.tasks("webshop-mini", "val", data_dir=REAL)
    assert (len(test), len(val), len(train)) == (3, 1, 12)   # a fifth test, a tenth val; test as before val
    assert [t.task_id for t in test] == ["webshop-mini/real/15", "webshop-mini/real/9", "webshop-mini/real/6"]
    ids = [t.task_id for t in test + val + train]
    assert len(set(ids)) == len(ids) == 16 and set(ids) == {t.task_id for t in tasks}
    assert not {t.instruction for t in val} & {t.instruction for t in test + train}
    env = envs.make("webshop-mini", "all", data_dir=REAL)
    for task in tasks:
        obs, _ = env.reset(task)
        assert task.instruction in obs
        _, reward, done, info = run(env, oracle_actions(env))
        assert done and reward == 1.0, (task.task_id, info.get("reward_info"))


def test_real_files_with_1500_goals_use_webshops_eval_goals_as_val(monkeypatch, tmp_path):
    """WebShop's own split of its shuffled goals: 0-499 test, 500-1499 eval (our val), 1500- train."""
    products, prices, goals = catalog_mod.load_webshop_dir(REAL)
    many = [dict(g, instruction_text=f"{g['instruction_text']} #{k}") for k in range(100) for g in goals]
    monkeypatch.setattr("envs.webshop_mini.load_webshop_dir", lambda _: (products, prices, many))
    split = {s: envs.tasks("webshop-mini", s, data_dir=str(tmp_path)) for s in ("train", "val", "test", "all")}
    assert {s: len(ts) for s, ts in split.items()} == {"train": 100, "val": 1000, "test": 500, "all": 1600}
    order = list(range(1600))
    random.Random(233).shuffle(order)
    assert [t.goal_index for t in split["val"]] == order[500:1500]
    assert [t.goal_index for t in split["test"]] == order[:500] and [t.goal_index for t in split["train"]] == order[1500:]


def test_real_sample_with_attribute_file(tmp_path):
    """items_ins_v2 gives products their attribute lists (WebShop's optional third file)."""
    for name in ("items_shuffle_1000.json", "items_human_ins.json"):
        shutil.copy(os.path.join(REAL, name), tmp_path / name)
    (tmp_path / "items_ins_v2_1000.json").write_text('{"B06Y3VLDFB": {"attributes": ["reclaimed wood"]}}')
    products, _, _ = catalog_mod.load_webshop_dir(str(tmp_path))
    by = {p["asin"]: p for p in products}
    assert by["B06Y3VLDFB"]["Attributes"] == ["reclaimed wood"] and by["B09DG92LJL"]["Attributes"] == ["DUMMY_ATTR"]


# --- a long random walk (its speed is bench.py's env_steps_per_s) ----------------------------
def test_a_long_random_walk_keeps_every_episode_well_formed():
    env = envs.make("webshop-mini", "train", seed=0)
    rng = random.Random(0)
    words = "red black lipstick vegan running shoes size 10 coffee dark roast dog bed grey bottle".split()
    tasks = envs.tasks("webshop-mini", "train")
    n, episodes = 0, 0
    while n < 3000:
        _, info = env.reset(rng.choice(tasks))
        done, steps, reward = False, 0, 0.0
        while not done:
            acts = info["admissible_actions"]
            assert acts, "a page with no admissible action"
            act = "search[" + " ".join(rng.sample(words, 3)) + "]" if acts == [SEARCH_FORM] else rng.choice(acts)
            _, reward, done, info = env.step(act)
            assert info["valid"], act   # every admissible action is accepted, random searches too
            n, steps = n + 1, steps + 1
        assert steps <= env.max_steps and 0.0 <= reward <= 1.0
        episodes += 1
    assert episodes > 100


# --- an interface a small model can use ---------------------------------------------------------
def test_every_page_ends_with_its_valid_actions():
    """Search, results, item and sub-pages all end with "Valid actions: ...", exactly the admissible ones."""
    env = envs.make("webshop-mini", "test", seed=1)
    rng = random.Random(1)
    pages = set()
    for task in envs.tasks("webshop-mini", "test")[:25]:
        obs, info = env.reset(task)
        done = False
        while not done:
            pages.add(info["page"])
            assert envs.valid_actions_of(obs) == info["admissible_actions"], obs
            assert obs.splitlines()[-1].startswith("Valid actions: ")
            acts = info["admissible_actions"]
            obs, _, done, info = env.step("search[" + task.instruction[:40] + "]" if acts == [SEARCH_FORM] else rng.choice(acts))
    assert {"search", "results", "item", "description", "features", "reviews"} <= pages


def test_near_miss_clicks_and_cut_off_searches_are_understood():
    env = envs.make("webshop-mini", "test")
    env.reset(envs.tasks("webshop-mini", "test")[3])
    obs, _, _, info = env.step("search[long lasting paraben free lipstick")    # the closing bracket was cut off
    assert info["valid"] and info["page"] == "results"
    products = [a for a in info["admissible_actions"] if a.startswith("click[b0")]
    target = products[2][6:-1]
    obs, _, _, info = env.step(f"click[{target[:-1]}]")                       # one character short
    assert info["valid"] and info["page"] == "item" and env.asin.lower() == target
    value = next(v for vs in env.catalog.by_asin[env.asin]["options"].values() for v in vs if len(v) >= 5)
    obs, _, _, info = env.step(f"click[{value[:-1]}]")
    assert info["valid"] and value in env.options.values()
    for far in ("click[b000000000]", "click[by]", "click[description of the item]"):
        obs, _, _, info = env.step(far)
        assert not info["valid"] and obs.startswith("Invalid action on the item page") and far not in obs


def test_the_example_episode_is_a_whole_valid_episode():
    """The example turns search, open a product, click an option and buy, each action listed as valid
    on its page, in the format of real pages."""
    demo = envs.make("webshop-mini").demo
    assert [a.split("[")[0] for _, a in demo] == ["search", "click", "click", "click"] and demo[-1][1] == "click[buy now]"
    for page, action in demo:
        valid = envs.valid_actions_of(page)
        assert action in valid or (valid == [SEARCH_FORM] and action.startswith("search["))
        assert page.startswith("Instruction: ")


def test_jax_kept_off_the_gpu_unless_the_user_chose():
    """bm25s runs jax at import; jax would reserve most of the GPU (the 3B GPU bench ran out of memory)."""
    import subprocess
    import sys
    code = "import os, envs.webshop_mini; print(os.environ['JAX_PLATFORMS'])"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    run = lambda e: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                                   check=True).stdout.strip()
    assert run(env) == "cpu"
    assert run({**env, "JAX_PLATFORMS": "cuda"}) == "cuda"
