"""webshop-mini: WebShop (Yao et al., 2022) in miniature, with a catalog that ships with the project.

The agent reads a shopping instruction, searches a catalog, opens products, picks options and
buys. Pages and actions are those of WebShop's text environment:

    search page   instruction and a search box          search[<your query>]
    results page  query, "Page N (Total results: M)",    click[back to search], click[next >],
                  10 products a page (ASIN, title, price) click[< prev], click[<asin>]
    item page     title, price, rating, option groups    click[<option value>], click[description],
                  with their values as buttons           click[features], click[reviews],
                                                         click[buy now], click[< prev], click[back to search]
    sub-pages     description, features, reviews         click[< prev], click[back to search]

Search is BM25 (bm25s) over each product's title, description, bullet points and options;
it returns the top 50 products with a positive score, 10 per page. info["admissible_actions"]
lists the actions valid on the current page (lower-case; matching ignores case).

Reward: WebShop's purchase reward in [0, 1] (envs/webshop_reward.py), paid once, at Buy Now,
which ends the episode; every other step pays 0. info["score"] is that reward (0 before a
purchase), info["won"] is reward == 1.0 (WebShop's success).
Step limit: 15 (make(max_steps=...)); invalid actions count as steps.
Splits (shipped catalog, envs/webshop_catalog.py): "train" (1,344 goals), "val" (168 goals, for
choosing hyper-parameters) and "test" (504 goals): same product types, val and test with new
instructions for new target products; "ood" (648 goals on 9 product types never seen in train)
and "all" (all 2,664). The val goals were train goals until val existed (train had 1,512); test
and ood did not change. With data_dir: "all", "test", "val" and "train" (see `tasks`).

What differs from real WebShop: the catalog (1,332 generated products in 37 types instead of
Amazon's 1.18M or 1k scraped ones); the noun tagger of the type reward (an approximation,
see webshop_reward.py); search is bm25s instead of pyserini/Lucene; observations are compact
lines (one per product, "[Button]" for clickables) instead of WebShop's "[SEP]"-joined text.
Real WebShop data loads with make("webshop-mini", data_dir=DIR).

    env = envs.make("webshop-mini", split="train", seed=0, max_steps=15, data_dir=None)
    obs, info = env.reset(task)     # task None: a random goal of the env's split
    env.goal                        # WebShop's goal dict of the episode (never shown to the policy)
    oracle_actions(env)             # a scripted expert's actions for that goal
After Buy Now, info["reward_info"] holds the reward's parts (r_type, r_att, r_option, r_price).
"""
from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

# bm25s runs a jax top-k when it is imported, if jax is installed, and jax then reserves 75 % of the GPU's
# memory for itself: on an H200 the 3B GPU bench ran out of memory with ~105 GiB held outside PyTorch.
# The index is small, so jax (which nothing else here uses) stays on the CPU unless the user chose otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import bm25s  # noqa: E402
import numpy as np
from rapidfuzz.distance import Levenshtein
from bm25s.stopwords import STOPWORDS_EN

from envs import Task, invalid_action_message, normalize_action, valid_actions_of
from envs.webshop_catalog import generate_catalog, load_webshop_dir
from envs.webshop_reward import (fuzzy_score, get_attribute_reward, get_option_reward,  # noqa: F401 (re-exported)
                                 get_reward, get_type_reward)

SEARCH_RETURN_N = 50
PRODUCT_WINDOW = 10
MAX_STEPS = 15
SEARCH_FORM = "search[<your query>]"
BACK, NEXT, PREV, BUY = "back to search", "next >", "< prev", "buy now"
SUB_PAGES = ("description", "features", "reviews")
SHIPPED_SPLITS = ("train", "val", "test", "ood", "all")
REAL_SPLITS = ("train", "val", "test", "all")
_TOKEN = re.compile(r"(?u)\b\w\w+\b")
_LOOSE_ACTION = re.compile(r"^(search|click)\s*\[\s*(.*?)\s*\]?$", re.S)
_STOP = frozenset(STOPWORDS_EN)


@dataclass(frozen=True)
class WebShopTask(Task):
    split: str = "train"
    goal_index: int = 0     # position in the catalog's goal list
    source: str = ""        # "" for the shipped catalog, else the data_dir it came from


def _tokens(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text.lower()) if t not in _STOP]


class Catalog:
    """Products, prices, goals and the search index of one data source, built once per process."""

    def __init__(self, source: str = ""):
        self.source = source
        if source:
            self.products, self.prices, self.goals = load_webshop_dir(source)
            order = list(range(len(self.goals)))
            random.Random(233).shuffle(order)   # WebShop shuffles its goals with seed 233
            # WebShop's convention: goals 0-499 test, 500-1499 val (its "eval"), 1500- train;
            # small files: the first fifth test, the next tenth val, the rest train
            n = len(order)
            n_test = 500 if n >= 1500 else max(1, n // 5)
            train_from = 1500 if n >= 1500 else n_test + n // 10
            self.split_goals = {"train": order[train_from:], "val": order[n_test:train_from],
                                "test": order[:n_test], "all": list(range(n))}
        else:
            self.products, by_split = generate_catalog()
            self.prices = {p["asin"]: p["pricing"][0] for p in self.products}
            # train then val fill the indices the train goals had before val existed, so test's and
            # ood's goal indices did not change
            self.goals, self.split_goals = [], {}
            for split in ("train", "val", "test", "ood"):
                start = len(self.goals)
                self.goals += by_split[split]
                self.split_goals[split] = list(range(start, len(self.goals)))
            self.split_goals["all"] = list(range(len(self.goals)))
        self.by_asin = {p["asin"]: p for p in self.products}
        self._build_index()
        self._search_cache: dict[str, list[int]] = {}
        self._tasks: dict[str, list[WebShopTask]] = {}

    def _build_index(self):
        vocab: dict[str, int] = {}
        ids = []
        for p in self.products:
            options = " ".join(f"{g} {' '.join(v)}" for g, v in p["options"].items())
            text = " ".join([p["Title"], p["Description"], " ".join(p["BulletPoints"]), options])
            ids.append([vocab.setdefault(t, len(vocab)) for t in _tokens(text)])
        self.vocab = vocab
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenization.Tokenized(ids=ids, vocab=vocab), show_progress=False)

    def search(self, query: str) -> list[int]:
        """Indices of the top products for a query (at most 50, positive BM25 score only)."""
        key = " ".join(query.lower().split())
        hit = self._search_cache.get(key)
        if hit is None:
            ids = [self.vocab[t] for t in _tokens(key) if t in self.vocab]
            if not ids:
                hit = []
            else:
                scores = self.index.get_scores_from_ids(ids)
                top = np.argsort(-scores, kind="stable")[:SEARCH_RETURN_N]
                hit = [int(i) for i in top if scores[i] > 0]
            if len(self._search_cache) > 20000:   # bounded: a long run sees many distinct queries
                self._search_cache.clear()
            self._search_cache[key] = hit
        return hit

    def tasks(self, split: str) -> list[WebShopTask]:
        if split not in self.split_goals:
            valid = ", ".join(self.split_goals)
            where = f"data_dir {self.source!r}" if self.source else "the shipped catalog"
            raise ValueError(f"unknown split {split!r} for webshop-mini with {where}; valid: {valid}")
        if split not in self._tasks:
            if split == "all" and not self.source:   # the union of the splits, with their own ids
                out = self.tasks("train") + self.tasks("val") + self.tasks("test") + self.tasks("ood")
            else:
                out = []
                for k, gi in enumerate(self.split_goals[split]):
                    tid = f"webshop-mini/real/{gi}" if self.source else f"webshop-mini/{split}/{k}"
                    out.append(WebShopTask(task_id=tid, instruction=self.goals[gi]["instruction_text"],
                                           split=split, goal_index=gi, source=self.source))
            self._tasks[split] = out
        return self._tasks[split]


_CATALOGS: dict[str, Catalog] = {}


def get_catalog(data_dir: str | None = None) -> Catalog:
    """The cached catalog of a data source (None: the shipped one)."""
    source = os.path.abspath(data_dir) if data_dir else ""
    if source not in _CATALOGS:
        _CATALOGS[source] = Catalog(source)
    return _CATALOGS[source]


def tasks(split: str, data_dir: str | None = None, **kwargs) -> list[WebShopTask]:
    """Tasks of a split. Shipped catalog: train, val, test, ood, all. With data_dir: every goal
    of the files in "all"; after WebShop's seed-233 shuffle, goals 0-499 are "test", 500-1499
    "val" (WebShop's "eval" goals) and 1500- "train" (with fewer than 1,500 goals: the first
    fifth is test, the next tenth val, the rest train; under 10 goals, val is empty)."""
    if kwargs:
        raise TypeError(f"webshop-mini tasks() does not take {', '.join(kwargs)}")
    return get_catalog(data_dir).tasks(split)


def task_kind(task: WebShopTask) -> str:
    """The product type a goal asks for (37 in the shipped catalog). Only warm_start.demonstrations reads
    it, to spread its goals over the types (--warm-start-spread); no agent or demonstrator sees it."""
    return get_catalog(task.source or None).goals[task.goal_index]["query"]


_DEMO_HEAD = "Instruction: i need a blue cotton t-shirt in size large, and price lower than 20.00 dollars"
_DEMO_ITEM = (_DEMO_HEAD + "\n[Back to Search] [< Prev]\nSunfield Cotton T-Shirt\nPrice: $12.99 | Rating: 4.5\n"
              "size: [medium] [large]")
_DEMO_BUTTONS = ("\n[Description] [Features] [Reviews] [Buy Now]\nValid actions: click[back to search], click[< prev], "
                 "click[medium], click[large], click[description], click[features], click[reviews], click[buy now]")


class WebShopMiniEnv:
    # An example episode shown before every episode (small models need it to answer with an action):
    # search with a short query, open a product, click the option the instruction names, buy.
    # (user, assistant) turns; the pages have the format of real ones.
    demo = [
        (_DEMO_HEAD + "\n[Search]\nValid actions: search[<your query>]", "search[blue cotton t-shirt]"),
        (_DEMO_HEAD + "\nPage 1 (Total results: 2) [Back to Search]\n[B0DEMO0001] Sunfield Cotton T-Shirt | $12.99\n"
         "[B0DEMO0002] Mistral Linen Shirt | $24.99\n"
         "Valid actions: click[back to search], click[b0demo0001], click[b0demo0002]", "click[b0demo0001]"),
        (_DEMO_ITEM + _DEMO_BUTTONS, "click[large]"),
        (_DEMO_ITEM + "\nYou have clicked large." + _DEMO_BUTTONS, "click[buy now]"),
    ]
    name = "webshop-mini"

    def __init__(self, catalog: Catalog, split: str = "train", seed: int = 0, max_steps: int = MAX_STEPS):
        self.catalog = catalog
        self.split = split
        self.max_steps = max_steps
        self.rng = random.Random(seed)
        self.task: WebShopTask | None = None
        self.goal: dict | None = None

    # --- protocol ----------------------------------------------------------------------
    def reset(self, task: WebShopTask | None = None):
        """Start an episode on the search page; task None draws a goal of this env's split."""
        if task is None:
            task = self.rng.choice(self.catalog.tasks(self.split))
        if not isinstance(task, WebShopTask):
            raise TypeError(f"webshop-mini needs a task from envs.tasks('webshop-mini', split), "
                            f"got {type(task).__name__}")
        if task.source != self.catalog.source:
            raise ValueError(f"task {task.task_id} comes from data source {task.source or 'shipped'!r}, "
                             f"this env uses {self.catalog.source or 'shipped'!r}")
        self.task, self.goal = task, self.catalog.goals[task.goal_index]
        self.steps, self.done, self.reward, self.reward_info = 0, False, 0.0, None
        self.query, self.results, self.page_num = "", [], 1
        self.asin, self.options = None, {}
        self._show("search")
        return self.obs, self._info(valid=True)

    def step(self, action: str):
        if self.task is None:
            raise RuntimeError("call reset(task) before step()")
        if self.done:
            return "The episode is over.", 0.0, True, self._info(valid=False)
        self.steps += 1
        text = action if isinstance(action, str) else str(action)
        act = normalize_action(text)
        loose = _LOOSE_ACTION.match(act)   # "click [ Buy Now ]" and a cut-off "search[red shoes" count
        if loose:
            act = f"{loose.group(1)}[{loose.group(2)}]"
        if act.startswith("click[") and act not in self.actions:
            act = self._near_click(act[6:-1]) or act
        valid = True
        if act in self.actions:
            self.actions[act]()              # a page transition; Buy Now also scores the purchase
            obs = self.obs
        elif self.page == "search" and act.startswith("search[") and act.endswith("]") and act[7:-1].strip():
            self._search(act[7:-1].strip())
            obs = self.obs
        else:
            valid = False
            obs = invalid_action_message(self.admissible, where=f" on the {self.page} page")
        reward = self.reward if self.page == "done" else 0.0   # paid once: later steps return early
        if self.steps >= self.max_steps:
            self.done = True
        return obs, reward, self.done, self._info(valid)

    def close(self):
        pass

    def _near_click(self, target: str) -> str | None:
        """The valid click whose target is within a small edit distance of `target` and closer than
        any other (at most 1 edit per 3 characters, at most 3), else None. Small models copy a
        10-character product id one character short; WebShop itself would reject it."""
        if not target:
            return None
        dist = sorted((Levenshtein.distance(target, a[6:-1]), a) for a in self.actions if a.startswith("click["))
        if not dist or (len(dist) > 1 and dist[1][0] == dist[0][0]):
            return None
        best, action = dist[0]
        return action if best <= max(1, min(3, (len(action) - 7) // 3)) else None

    def _info(self, valid: bool) -> dict:
        info = {"task_id": self.task.task_id, "instruction": self.goal["instruction_text"],
                "admissible_actions": list(self.admissible), "score": self.reward,
                "won": self.reward == 1.0, "valid": valid, "page": self.page}
        if self.reward_info is not None:
            info["reward_info"] = self.reward_info
        return info

    # --- page transitions ------------------------------------------------------------------
    def _search(self, query: str):
        self.query, self.page_num = query, 1
        self.results = self.catalog.search(query)
        self.asin, self.options = None, {}
        self._show("results")

    def _to_search(self):
        self.query, self.results, self.asin, self.options = "", [], None, {}
        self._show("search")

    def _turn(self, delta: int):
        self.page_num += delta
        self._show("results")

    def _open(self, asin: str):
        self.asin, self.options = asin, {}
        self._show("item")

    def _back_to_results(self):
        # "< Prev" on an item page returns to the results page it was opened from
        self.asin, self.options = None, {}
        self._show("results")

    def _choose(self, group: str, value: str):
        self.options[group] = value          # one value per option group, as in WebShop
        self._show("item")

    def _buy(self):
        product = self.catalog.by_asin[self.asin]
        reward, self.reward_info = get_reward(product, self.goal, price=self.catalog.prices[self.asin],
                                              options=self.options, verbose=True)
        self.reward, self.done = float(reward), True
        chosen = ", ".join(f"{g}: {v}" for g, v in self.options.items()) or "no options"
        self.page, self.actions, self.admissible = "done", {}, []
        self.obs = (f"Thank you for shopping with us! You bought {self.asin} ({chosen}).\n"
                    f"Your score (min 0.0, max 1.0): {self.reward:.2f}")

    # --- rendering -------------------------------------------------------------------------
    def _show(self, page: str):
        """Render `page` and rebuild its clickables: action text -> transition."""
        self.page = page
        head = f"Instruction: {self.goal['instruction_text']}"
        acts: dict = {}
        if page == "search":
            self.actions, self.admissible = acts, [SEARCH_FORM]
            self.obs = f"{head}\n[Search]\nValid actions: {SEARCH_FORM}"
            return
        acts[f"click[{BACK}]"] = self._to_search
        if page == "results":
            total = len(self.results)
            shown = self.results[(self.page_num - 1) * PRODUCT_WINDOW:self.page_num * PRODUCT_WINDOW]
            buttons = ["[Back to Search]"]
            if self.page_num > 1:
                acts[f"click[{PREV}]"] = lambda: self._turn(-1)
                buttons.append("[< Prev]")
            if self.page_num * PRODUCT_WINDOW < total:
                acts[f"click[{NEXT}]"] = lambda: self._turn(+1)
                buttons.append("[Next >]")
            lines = [head, f"Page {self.page_num} (Total results: {total}) " + " ".join(buttons)]
            for i in shown:
                p = self.catalog.products[i]
                acts[f"click[{p['asin'].lower()}]"] = (lambda a=p["asin"]: self._open(a))
                title = p["Title"] if len(p["Title"]) <= 90 else p["Title"][:87] + "..."
                lines.append(f"[{p['asin']}] {title} | {p['Price']}")
            if not shown:
                lines.append("No products match this query.")
        elif page == "item":
            p = self.catalog.by_asin[self.asin]
            acts[f"click[{PREV}]"] = self._back_to_results
            lines = [head, "[Back to Search] [< Prev]", p["Title"], f"Price: {p['Price']} | Rating: {p['Rating']}"]
            for group, values in p["options"].items():
                for v in values:
                    key = normalize_action(f"click[{v}]")
                    acts.setdefault(key, (lambda g=group, val=v: self._choose(g, val)))
                lines.append(f"{group}: " + " ".join(f"[{v}]" for v in values))
            if self.options:
                lines.append("You have clicked " + ", ".join(self.options.values()) + ".")
            for sub in SUB_PAGES:
                acts[f"click[{sub}]"] = (lambda s=sub: self._show(s))
            acts[f"click[{BUY}]"] = self._buy
            lines.append("[Description] [Features] [Reviews] [Buy Now]")
        else:   # description, features, reviews
            p = self.catalog.by_asin[self.asin]
            acts[f"click[{PREV}]"] = lambda: self._show("item")
            lines = [head, "[Back to Search] [< Prev]"]
            if page == "description":
                lines.append(f"Description: {p['Description'] or 'N.A.'}")
            elif page == "features":
                lines += [f"- {b}" for b in p["BulletPoints"]] or ["No features listed."]
            else:
                lines.append(f"Rating: {p['Rating']}. " + (" | ".join(
                    str(r.get("body", "")) for r in p["Reviews"][:3]) or "No written reviews."))
        self.actions, self.admissible = acts, list(acts)
        self.obs = "\n".join(lines + ["Valid actions: " + ", ".join(self.admissible)])


def make(split: str = "train", seed: int = 0, max_steps: int = MAX_STEPS, data_dir: str | None = None,
         **kwargs) -> WebShopMiniEnv:
    if kwargs:
        raise TypeError(f"webshop-mini does not take {', '.join(kwargs)}")
    catalog = get_catalog(data_dir)
    if split not in catalog.split_goals:
        catalog.tasks(split)   # raises the ValueError naming the valid splits
    return WebShopMiniEnv(catalog, split=split, seed=seed, max_steps=max_steps)


_NAVIGATION = {f"click[{b}]" for b in (BACK, NEXT, PREV, BUY, *SUB_PAGES)}


def option_groups(obs: str) -> list[list[str]]:
    """The values of each option group an item page shows ("color: [red] [blue]" -> ["red", "blue"])."""
    groups = [re.findall(r"\[([^\]]+)\]", line) for line in obs.splitlines() if ": [" in line]
    return [values for values in groups if values]


def demonstrator(obs: str, rng: random.Random, max_query_words: int = 10) -> str:
    """The warm start's demonstrator: WebShop's rule baseline (search the instruction, open the first
    result, buy) that also clicks a random value of every option group before buying.

    It reads only the observation the agent sees, never the goal. The query is the instruction
    without its price clause, at most `max_query_words` words, so that it fits the action budget.
    The random options are our addition: the plain rule baseline never clicks an option, so a policy
    cloned from it would almost never try one, and options are what RL has to learn here (measured
    on 300 test goals: 67.4 score / 10.3 % success without options, 77.9 / 30.7 % with random ones)."""
    valid = valid_actions_of(obs)
    if valid == [SEARCH_FORM]:
        instruction = obs.split("\n")[0].removeprefix("Instruction: ")
        query = re.split(r",? and price lower than", instruction)[0].split()[:max_query_words]
        return f"search[{' '.join(query)}]"
    products = [a for a in valid if a.startswith("click[") and a not in _NAVIGATION]
    if "click[buy now]" in valid:   # item page: one random value per option group, then buy
        clicked = next((line[len("You have clicked "):-1].split(", ") for line in obs.splitlines()
                        if line.startswith("You have clicked ")), [])
        for values in option_groups(obs):
            if not set(values) & set(clicked):
                return f"click[{rng.choice(values)}]"
        return "click[buy now]"
    if "(Total results: " in obs:   # a results page: the first product
        return products[0] if products else "click[back to search]"
    return "click[< prev]"          # description, features or reviews: back to the item


def oracle_actions(env: WebShopMiniEnv) -> list[str]:
    """A scripted expert for the current goal (call after reset): search the target's title,
    page to it, open it, click the goal's options, buy. Used by tests and notebooks."""
    goal, catalog = env.goal, env.catalog
    target = catalog.by_asin[goal["asin"]]
    actions, position = [], None
    for query in (goal["name"], goal["query"]):
        query = " ".join(query.split())
        hits = [catalog.products[i]["asin"] for i in catalog.search(query)]
        if goal["asin"] in hits:
            actions, position = [f"search[{query}]"], hits.index(goal["asin"])
            break
    if position is None:   # the target cannot be found: buy the best hit for its title
        hits = catalog.search(goal["name"])
        if not hits:
            return [f"search[{goal['name']}]"]
        target, position = catalog.products[hits[0]], 0
        actions = [f"search[{goal['name']}]"]
    actions += ["click[next >]"] * (position // PRODUCT_WINDOW)
    actions.append(f"click[{target['asin'].lower()}]")
    wanted = list(goal["goal_options"].values()) if isinstance(goal["goal_options"], dict) else goal["goal_options"]
    for value in wanted:
        best = _closest_option(target["options"], value)
        if best is not None:
            actions.append(f"click[{best}]")
    actions.append(f"click[{BUY}]")
    return actions


def _closest_option(options: dict, wanted: str) -> str | None:
    """The product's option value equal to `wanted`, else the best fuzzy match above WebShop's 85."""
    values = [v for vs in options.values() for v in vs]
    norm = " ".join(wanted.lower().split())
    for v in values:
        if " ".join(v.split()) == norm:
            return v
    scored = [(fuzzy_score(v, wanted), -i, v) for i, v in enumerate(values)]
    best = max(scored, default=None)
    return best[2] if best and best[0] > 85 else None
