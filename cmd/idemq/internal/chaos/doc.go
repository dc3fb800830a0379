// Package chaos is idemq's chaos harness, the engine of `idemq chaos`: it
// publishes a workload with producer duplicates to RabbitMQ and Kafka
// (kfake), runs several consumer OS processes (workers, see WorkerMain)
// that apply each message's effect through consumer.Runtime into Postgres,
// injects faults while they work (SIGKILLs at random and right after
// COMMIT, Postgres connection resets at COMMIT and latency through a TCP
// proxy, AMQP connection drops after commit, Postgres and RabbitMQ
// restarts on a private cluster and node, SIGKILLs of the nodes of a private
// 3-node RabbitMQ cluster serving a quorum queue, Kafka rebalances and
// offset-commit errors, handlers slower than consumer_timeout), and then
// checks the sets: published-and-confirmed ids, processed_messages ids and
// business effects; on the cluster also the longest stall between applies
// (Stall, ClusterStallBound).
//
// Run runs scenarios (ShortSuite, LongSuite or your own); Check is the
// set comparison; RELIABILITY.md at the repository root records results.
package chaos
