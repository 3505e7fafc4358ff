"""Exactly-once delivery (OUTBOX_DELIVERY=exactly-once; docs/design/exactly-once.md): the wing
of the Kafka side that sends a claim's rows in one Kafka transaction and marks them only once
that transaction is known committed.

Kept apart from the at-least-once path (kafka/publisher.py, kafka/delivery.py) because its
state (lanes of transactional producers, progress records, holds, fences) is its own, and a
reader of one path should not have to step over the other.

The flow of one claim: claim -> transaction -> progress -> mark. The claim's rows go out in one
transaction on a lane's producer (publisher.py sends a delivery.py); the transaction is ended
by the lane's progress record (progress.py), which says which (id, replays) pairs it committed;
only then are the rows marked. A claim that took rows over from a lost dispatcher is reconciled
first (takeover.py fences the lost owner's transactional ids and reads what it committed).

Its modules:
- publisher.py: the TransactionalPublisher, which sends a claim's delivery in a transaction.
- delivery.py: one claim's transactions (its rows, its lane, what each transaction's state
  lets it list, settle and give back).
- transaction.py: a transaction's states and the moves between them.
- endings.py: how a transaction ends (committed, aborted, its outcome unknown).
- lanes.py: the two transactional producers of a process and their generations' ids.
- progress.py: the progress record's form, its reading, and fencing a transactional id.
- topic.py: the progress topic, checked at start and before every read.
- takeover.py: fencing a lost dispatcher's ids and deciding its rows.
- retirement.py: keeping the progress records bounded (lists and tombstones).
- replicas.py: which partitions are short of in-sync replicas.
- stalls.py: holds on partitions that did not acknowledge in time.
- store.py: ProgressStore, what the wing asks of the outbox table (the store seam; the
  dispatcher's adapter: dispatch/progress_store.py).
"""
