"""Nexmark's events (persons, auctions, bids), generated as the Nexmark benchmark's own generator
does (Beam's ``NexmarkGenerator``, which Flink's nexmark repository reuses), vectorised with numpy.

Event ``i`` of the stream is a person, an auction or a bid by its place in each run of 50
events (proportions 1 : 3 : 46); it happens at ``i / rate`` seconds after ``start``. Ids and the
hot keys follow the generator's rules and defaults:

- persons and auctions are numbered from 1000 in the order they appear;
- a bid's auction is a hot one (the latest auction rounded down to a multiple of 100) with
  probability ``1 - 1/hot_auction_ratio`` (default 1/2), else one of the last
  ``in_flight_auctions`` (100) auctions or the next few;
- a bid's bidder is a hot one (the latest person rounded down to a multiple of 100, plus 1)
  with probability ``1 - 1/hot_bidder_ratio`` (3/4), else one of the last ``active_people``
  (1000) persons or the next few; an auction's seller likewise (``hot_seller_ratio``, 3/4);
- prices are ``round(10 ** U(0, 6) * 100)`` (cents, log-uniform), a reserve is the initial bid
  plus such a price, categories are 10-14;
- a bid's channel is one of 4 hot channels with probability 1/2, else one of 10,000.

Out of order: with probability ``prob_delayed`` (0.1), an event's time is earlier than its place
by up to ``delay_s`` seconds (3), uniformly: the spec's ``probDelayedEvent`` and
``occasionalDelaySec``. A watermark of ``delay_s`` plus a second loses no event.

Examples
--------
>>> from nexmark_gen import generate
>>> ev = generate(5000, seed=1)
>>> [len(ev[k]["id" if k != "bid" else "auction"]) for k in ("person", "auction", "bid")]
[100, 300, 4600]
>>> int(ev["auction"]["id"][0]), int(ev["person"]["id"][0])
(1000, 1000)
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Dict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

PERSON_P, AUCTION_P, BID_P = 1, 3, 46
TOTAL_P = PERSON_P + AUCTION_P + BID_P
FIRST_PERSON_ID = FIRST_AUCTION_ID = 1000
FIRST_CATEGORY_ID, NUM_CATEGORIES = 10, 5
HOT_AUCTION_RATIO = HOT_SELLER_RATIO = HOT_BIDDER_RATIO = 100  # (hot ids: multiples of 100)
AUCTION_ID_LEAD = PERSON_ID_LEAD = 10
HOT_CHANNELS = np.array(["Google", "Facebook", "Baidu", "Apple"])
HOT_URLS = np.array([f"https://www.nexmark.com/{c.lower()}/item.htm?query=1"
                     for c in HOT_CHANNELS])
CHANNELS = 10_000
US_STATES = np.array(["AZ", "CA", "ID", "OR", "WA", "WY"])
US_CITIES = np.array(["Phoenix", "Los Angeles", "San Francisco", "Boise", "Portland", "Bend",
                      "Redmond", "Seattle", "Kent", "Cheyenne"])
FIRST_NAMES = np.array(["Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie",
                        "Sarah", "Deiter", "Walter"])
LAST_NAMES = np.array(["Shultz", "Abrams", "Spencer", "White", "Bartels", "Walton", "Smith",
                       "Jones", "Noris"])

BID_SCHEMA = ("auction BIGINT, bidder BIGINT, price BIGINT, channel STRING, url STRING, "
              "dateTime TIMESTAMP, extra STRING")
AUCTION_SCHEMA = ("id BIGINT, itemName STRING, description STRING, initialBid BIGINT, "
                  "reserve BIGINT, dateTime TIMESTAMP, expires TIMESTAMP, seller BIGINT, "
                  "category BIGINT, extra STRING")
PERSON_SCHEMA = ("id BIGINT, name STRING, emailAddress STRING, creditCard STRING, city STRING, "
                 "state STRING, dateTime TIMESTAMP, extra STRING")


def last_base0_auction_id(event: np.ndarray) -> np.ndarray:
    """The 0-based id of the latest auction at or before each event id."""
    epoch, offset = event // TOTAL_P, event % TOTAL_P
    before = offset < PERSON_P
    epoch = np.where(before, epoch - 1, epoch)
    offset = np.where(before | (offset >= PERSON_P + AUCTION_P), AUCTION_P - 1,
                      offset - PERSON_P)
    return epoch * AUCTION_P + offset


def last_base0_person_id(event: np.ndarray) -> np.ndarray:
    """The 0-based id of the latest person at or before each event id."""
    epoch, offset = event // TOTAL_P, event % TOTAL_P
    return epoch * PERSON_P + np.minimum(offset, PERSON_P - 1)


def _next_person(rng, event, active_people):
    people = last_base0_person_id(event) + 1
    active = np.minimum(people, active_people)
    return people - active + (rng.random(len(event)) * (active + PERSON_ID_LEAD)).astype(np.int64)


def _next_auction(rng, event, in_flight):
    last = last_base0_auction_id(event)
    lo = np.maximum(last - in_flight, 0)
    return lo + (rng.random(len(event)) * (last - lo + 1 + AUCTION_ID_LEAD)).astype(np.int64)


def _price(rng, n):
    return np.round(10.0 ** (rng.random(n) * 6.0) * 100.0).astype(np.int64)


def _hot(rng, n, ratio):
    """Which of ``n`` draws take the hot key (``nextInt(ratio) > 0``)."""
    return rng.integers(0, ratio, n) > 0


def generate(n: int, first: int = 0, rate: float = 10_000.0, seed: int = 0,
             start: datetime.datetime = datetime.datetime(2026, 1, 1),
             hot_auction_ratio: int = 2, hot_seller_ratio: int = 4, hot_bidder_ratio: int = 4,
             in_flight_auctions: int = 100, active_people: int = 1000,
             prob_delayed: float = 0.1, delay_s: float = 3.0) -> Dict[str, Dict[str, np.ndarray]]:
    """Events ``first`` to ``first + n - 1`` of the stream, as columns per kind:
    ``{"person": {...}, "auction": {...}, "bid": {...}}`` (times in microseconds since the
    epoch, ``dateTime``). The same ``seed`` and ``first`` give the same events, so a stream
    is generated in chunks."""
    rng = np.random.default_rng([seed, first])
    event = np.arange(first, first + n, dtype=np.int64)
    t0 = int(start.replace(tzinfo=datetime.timezone.utc).timestamp() * 1e6)
    ts = t0 + (event * (1e6 / rate)).astype(np.int64)
    late = rng.random(n) < prob_delayed
    ts = ts - np.where(late, (rng.random(n) * delay_s * 1e6).astype(np.int64), 0)
    offset = event % TOTAL_P
    kinds = {"person": offset < PERSON_P,
             "auction": (offset >= PERSON_P) & (offset < PERSON_P + AUCTION_P),
             "bid": offset >= PERSON_P + AUCTION_P}
    out = {}

    e, t = event[kinds["person"]], ts[kinds["person"]]
    m = len(e)
    first_name, last_name = (rng.integers(0, len(FIRST_NAMES), m),
                             rng.integers(0, len(LAST_NAMES), m))
    name = np.char.add(np.char.add(FIRST_NAMES[first_name], " "), LAST_NAMES[last_name])
    out["person"] = {
        "id": last_base0_person_id(e) + FIRST_PERSON_ID, "name": name,
        "emailAddress": np.char.add(np.char.add(LAST_NAMES[last_name], "@"),
                                    np.char.add(FIRST_NAMES[first_name], ".com")),
        "creditCard": np.array([f"{x:04d} {y:04d} {z:04d} {w:04d}" for x, y, z, w in
                                rng.integers(0, 10_000, (m, 4))]) if m else np.array([], str),
        "city": US_CITIES[rng.integers(0, len(US_CITIES), m)],
        "state": US_STATES[rng.integers(0, len(US_STATES), m)],
        "dateTime": t, "extra": np.full(m, "")}

    e, t = event[kinds["auction"]], ts[kinds["auction"]]
    m = len(e)
    seller = np.where(_hot(rng, m, hot_seller_ratio),
                      (last_base0_person_id(e) // HOT_SELLER_RATIO) * HOT_SELLER_RATIO,
                      _next_person(rng, e, active_people)) + FIRST_PERSON_ID
    initial = _price(rng, m)
    ids = last_base0_auction_id(e) + FIRST_AUCTION_ID
    # An auction stays open for about as long as in_flight_auctions auctions take to appear.
    life = in_flight_auctions * TOTAL_P / AUCTION_P / rate * 1e6
    out["auction"] = {
        "id": ids, "itemName": np.char.add("item-", ids.astype(str)),
        "description": np.full(m, "a Nexmark item"), "initialBid": initial,
        "reserve": initial + _price(rng, m), "dateTime": t,
        "expires": t + (rng.random(m) * 2 * life).astype(np.int64) + 1,
        "seller": seller,
        "category": FIRST_CATEGORY_ID + rng.integers(0, NUM_CATEGORIES, m),
        "extra": np.full(m, "")}

    e, t = event[kinds["bid"]], ts[kinds["bid"]]
    m = len(e)
    auction = np.where(_hot(rng, m, hot_auction_ratio),
                       (last_base0_auction_id(e) // HOT_AUCTION_RATIO) * HOT_AUCTION_RATIO,
                       _next_auction(rng, e, in_flight_auctions)) + FIRST_AUCTION_ID
    bidder = np.where(_hot(rng, m, hot_bidder_ratio),
                      (last_base0_person_id(e) // HOT_BIDDER_RATIO) * HOT_BIDDER_RATIO + 1,
                      _next_person(rng, e, active_people)) + FIRST_PERSON_ID
    hot = _hot(rng, m, 2)
    which = rng.integers(0, len(HOT_CHANNELS), m)
    cold = rng.integers(0, CHANNELS, m)
    out["bid"] = {
        "auction": auction, "bidder": bidder, "price": _price(rng, m),
        "channel": np.where(hot, HOT_CHANNELS[which], np.char.add("channel-", cold.astype(str))),
        "url": np.where(hot, HOT_URLS[which],
                        np.char.add("https://www.nexmark.com/item.htm?channel_id=",
                                    cold.astype(str))),
        "dateTime": t, "extra": np.full(m, "")}
    return out


def table(columns: Dict[str, np.ndarray]) -> pa.Table:
    """One kind's columns as an Arrow table (times as microsecond timestamps in UTC, as Spark
    writes its timestamps)."""
    arrays = {}
    for name, col in columns.items():
        if name in ("dateTime", "expires"):
            arrays[name] = pa.array(col, pa.timestamp("us", tz="UTC"))
        elif col.dtype.kind == "U":
            arrays[name] = pa.array(col.tolist(), pa.string())
        else:
            arrays[name] = pa.array(col)
    return pa.table(arrays)


def chunks(events: int, n: int, rate: float = 10_000.0, seed: int = 0):
    """The stream's ``events`` events in ``n`` consecutive chunks of event ids (as
    :func:`generate` gives them), in order."""
    bounds = np.linspace(0, events, n + 1).astype(np.int64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        yield generate(int(b - a), first=int(a), rate=rate, seed=seed)


def write(root: Path, events: int, files: int, rate: float = 10_000.0, seed: int = 0,
          kinds=("person", "auction", "bid")) -> Path:
    """``events`` events as Parquet under ``root/<kind>/``, ``files`` files per kind, each file
    the same range of event ids for every kind (a micro-batch of ``maxFilesPerTrigger=1``),
    written in order so their modification times increase. ``root``."""
    root = Path(root)
    for kind in kinds:
        (root / kind).mkdir(parents=True, exist_ok=True)
    for i, ev in enumerate(chunks(events, files, rate, seed)):
        for kind in kinds:
            pq.write_table(table(ev[kind]), root / kind / f"part-{i:05d}.parquet")
    return root


def to_kafka(broker, events: int, n_chunks: int = 10, rate: float = 10_000.0, seed: int = 0,
             kinds=("person", "auction", "bid"), partitions: int = 2) -> Dict[str, int]:
    """``events`` events as JSON records (one object per event, times as ISO-8601 strings) on
    topics ``person``, ``auction`` and ``bid`` of ``broker``
    (:class:`spark_stretch.testing.kafka.KafkaBroker`), each made with ``partitions``
    partitions, generated in ``n_chunks`` chunks as :func:`write` writes files. The records per
    topic."""
    for kind in kinds:
        broker.create_topic(kind, partitions)
    counts = dict.fromkeys(kinds, 0)
    for ev in chunks(events, n_chunks, rate, seed):
        for kind in kinds:
            counts[kind] += broker.produce(kind, ((None, x) for x in json_lines(ev[kind])))
    return counts


def json_lines(columns: Dict[str, np.ndarray]) -> list:
    """One kind's events as JSON records (bytes, one object each; times as ISO-8601 strings
    in UTC without a zone, as Spark's ``from_json`` reads them with the session zone UTC)."""
    frame = table(columns).to_pandas()
    for col in ("dateTime", "expires"):
        if col in frame:
            frame[col] = frame[col].dt.strftime("%Y-%m-%dT%H:%M:%S.%f")
    return [x.encode() for x in frame.to_json(orient="records", lines=True).splitlines()]
