"""dualwrite: atomic writes to a SQL database and Apache Kafka (KIP-939 on today's brokers)."""
