"""The Kafka side: records, waves, producers, topic lookups, one claim's delivery, and the thin
publisher over them; exactly-once is its own wing (kafka/exactly_once/). Only kafka/internals.py
reaches below aiokafka's public API."""
