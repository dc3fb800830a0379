// Package integration holds idemq's end-to-end suites against real brokers
// and a real Postgres started in containers with testcontainers-go. Its tests
// are behind the build tag "integration":
//
//	go test -race -tags integration -count=1 ./integration/...
//
// Each service starts once per test binary, on first use, from the official
// image (postgres:16, rabbitmq:3, apache/kafka) unless overridden:
//
//	IDEMQ_TEST_POSTGRES_IMAGE   image for Postgres (default postgres:16)
//	IDEMQ_TEST_RABBITMQ_IMAGE   image for RabbitMQ (default rabbitmq:3)
//	IDEMQ_TEST_KAFKA_IMAGE      image for Kafka (default apache/kafka:3.9.1)
//
// or replaced by an existing endpoint, in which case no container is started
// for it:
//
//	IDEMQ_TEST_POSTGRES_URL     e.g. postgres://postgres@127.0.0.1:5432/test
//	IDEMQ_TEST_AMQP_URL         e.g. amqp://guest:guest@127.0.0.1:5672/
//	IDEMQ_TEST_KAFKA_BROKERS    comma-separated host:port list
//
// The fault tests (TestFault*) stop, kill or pause a container, so they need
// the container: with an endpoint instead they fail with a message saying so.
// Leave them out with -skip Fault.
//
// Ports are published on 127.0.0.1 only, at a host port chosen free when the
// container is created and kept across restarts, so clients reconnect to the
// same address after a fault.
//
// An image named by an override must behave like the official one it
// replaces: start its server with no command given, and accept the official
// image's environment (POSTGRES_HOST_AUTH_METHOD=trust; the KAFKA_*
// listener variables, or IDEMQ_KFAKE_LISTEN and IDEMQ_KFAKE_ADVERTISE for
// cmd/kfake-server). .ci/containers.sh builds such images from Debian
// packages for machines without a registry.
package integration
