// Package wire holds what the broker adapters write on the wire the same
// way, so that each name is said once.
package wire

// KeyHeader is the header (the entry field on Redis Streams) that carries
// Message.Key, the ordering key, on RabbitMQ, NATS and Redis Streams: their
// Publishers write a non-empty Key there and their Sources and Browsers
// read Key from it. Kafka's ordering key is its partition.
const KeyHeader = "x-idemq-key"
