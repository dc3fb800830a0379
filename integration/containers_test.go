//go:build integration

package integration

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/api/types/network"
	"github.com/moby/moby/client"
	amqp "github.com/rabbitmq/amqp091-go"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/testcontainers/testcontainers-go"
)

// Environment variables that configure the suite; see the package doc.
const (
	envPostgresImage = "IDEMQ_TEST_POSTGRES_IMAGE"
	envRabbitImage   = "IDEMQ_TEST_RABBITMQ_IMAGE"
	envKafkaImage    = "IDEMQ_TEST_KAFKA_IMAGE"
	envPostgresURL   = "IDEMQ_TEST_POSTGRES_URL"
	envAMQPURL       = "IDEMQ_TEST_AMQP_URL"
	envKafkaBrokers  = "IDEMQ_TEST_KAFKA_BROKERS"
)

// Official images used when no override is set. Kafka is pinned to 3.9:
// Kafka 4.0.0 dropped the JoinGroup v1 that kafka-go's consumer groups use.
const (
	defaultPostgresImage = "postgres:16"
	defaultRabbitImage   = "rabbitmq:3"
	defaultKafkaImage    = "apache/kafka:3.9.1"
)

// Bounds on waiting for a server to accept clients, after a start or a
// restart. RabbitMQ and Kafka take 10-30s on a small machine.
const (
	postgresReadyTimeout = 90 * time.Second
	rabbitReadyTimeout   = 3 * time.Minute
	kafkaReadyTimeout    = 3 * time.Minute
)

// service is one backing service: a container the suite started, or an
// endpoint given in the environment.
type service struct {
	name string // "postgres", "rabbitmq", "kafka"
	// endpointVar is the variable that replaces the container.
	endpointVar string
	image       string
	hostPort    int
	// ctr is nil when the service is an existing endpoint.
	ctr *testcontainers.DockerContainer
	// ready polls the service once; it returns nil when clients can use it.
	ready        func(ctx context.Context) error
	readyTimeout time.Duration
}

// lazy starts a service on first use and remembers the outcome, so a test
// binary that runs only the Postgres tests never starts RabbitMQ.
type lazy struct {
	once sync.Once
	svc  *service
	err  error
	// endpoint is the URL or address tests connect to.
	endpoint string
}

func (l *lazy) get(t testing.TB, start func() (*service, string, error)) (*service, string) {
	t.Helper()
	l.once.Do(func() {
		l.svc, l.endpoint, l.err = start()
		if l.svc != nil && l.svc.ctr != nil {
			started.add(l.svc)
		}
	})
	if l.err != nil {
		t.Fatal(l.err)
	}
	return l.svc, l.endpoint
}

// started lists the containers to terminate when the package's tests end.
var started registry

type registry struct {
	mu   sync.Mutex
	svcs []*service
}

func (r *registry) add(svc *service) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.svcs = append(r.svcs, svc)
}

func TestMain(m *testing.M) {
	code := m.Run()
	if err := terminateAll(); err != nil {
		fmt.Fprintln(os.Stderr, "integration:", err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

func terminateAll() error {
	started.mu.Lock()
	defer started.mu.Unlock()
	var errs []error
	for _, s := range started.svcs {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		// A paused container cannot be stopped; make sure it is not.
		_ = s.unpauseErr(ctx)
		if err := s.ctr.Terminate(ctx); err != nil {
			errs = append(errs, fmt.Errorf("terminate %s container: %w", s.name, err))
		}
		cancel()
	}
	return errors.Join(errs...)
}

var (
	pgLazy     lazy
	rabbitLazy lazy
	kafkaLazy  lazy
)

// postgres returns the Postgres service and a URL for its "postgres"
// database.
func postgres(t testing.TB) (*service, string) {
	return pgLazy.get(t, startPostgres)
}

// rabbit returns the RabbitMQ service and its AMQP URL.
func rabbit(t testing.TB) (*service, string) {
	return rabbitLazy.get(t, startRabbit)
}

// kafkaService returns the Kafka service and its bootstrap addresses.
func kafkaService(t testing.TB) (*service, []string) {
	svc, brokers := kafkaLazy.get(t, startKafka)
	return svc, strings.Split(brokers, ",")
}

func startPostgres() (*service, string, error) {
	if u := os.Getenv(envPostgresURL); u != "" {
		s := &service{name: "postgres", endpointVar: envPostgresURL, ready: pgReady(u), readyTimeout: 10 * time.Second}
		return s, u, s.waitReady(context.Background())
	}
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	url := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	s := &service{
		name:         "postgres",
		endpointVar:  envPostgresURL,
		image:        envOr(envPostgresImage, defaultPostgresImage),
		hostPort:     port,
		ready:        pgReady(url),
		readyTimeout: postgresReadyTimeout,
	}
	err = s.run(testcontainers.WithEnv(map[string]string{
		// The official image; local images ignore it.
		"POSTGRES_HOST_AUTH_METHOD": "trust",
	}), testcontainers.WithConfigModifier(func(c *container.Config) {
		// A fast shutdown on stop, whatever the image says.
		c.StopSignal = "SIGINT"
	}))
	return s, url, err
}

func startRabbit() (*service, string, error) {
	if u := os.Getenv(envAMQPURL); u != "" {
		s := &service{name: "rabbitmq", endpointVar: envAMQPURL, ready: amqpReady(u), readyTimeout: 10 * time.Second}
		return s, u, s.waitReady(context.Background())
	}
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	url := fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", port)
	s := &service{
		name:         "rabbitmq",
		endpointVar:  envAMQPURL,
		image:        envOr(envRabbitImage, defaultRabbitImage),
		hostPort:     port,
		ready:        amqpReady(url),
		readyTimeout: rabbitReadyTimeout,
	}
	return s, url, s.run()
}

func startKafka() (*service, string, error) {
	if b := os.Getenv(envKafkaBrokers); b != "" {
		s := &service{name: "kafka", endpointVar: envKafkaBrokers, ready: kafkaReady(b), readyTimeout: 10 * time.Second}
		return s, b, s.waitReady(context.Background())
	}
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	// The broker must advertise the address clients reach it at: the host
	// side of the mapping, which is the same port on 127.0.0.1.
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	p := strconv.Itoa(port)
	s := &service{
		name:         "kafka",
		endpointVar:  envKafkaBrokers,
		image:        envOr(envKafkaImage, defaultKafkaImage),
		hostPort:     port,
		ready:        kafkaReady(addr),
		readyTimeout: kafkaReadyTimeout,
	}
	err = s.run(testcontainers.WithEnv(map[string]string{
		// apache/kafka: a one-node KRaft cluster. Setting any KAFKA_
		// variable replaces the image's defaults, hence the full set.
		"KAFKA_NODE_ID":                                  "1",
		"KAFKA_PROCESS_ROLES":                            "broker,controller",
		"KAFKA_LISTENERS":                                "PLAINTEXT://0.0.0.0:" + p + ",CONTROLLER://localhost:9093",
		"KAFKA_ADVERTISED_LISTENERS":                     "PLAINTEXT://" + addr,
		"KAFKA_CONTROLLER_LISTENER_NAMES":                "CONTROLLER",
		"KAFKA_LISTENER_SECURITY_PROTOCOL_MAP":           "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
		"KAFKA_CONTROLLER_QUORUM_VOTERS":                 "1@localhost:9093",
		"KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR":         "1",
		"KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
		"KAFKA_TRANSACTION_STATE_LOG_MIN_ISR":            "1",
		"KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS":         "0",
		"KAFKA_NUM_PARTITIONS":                           "3",
		// cmd/kfake-server (idemq-test/kfake), the Kafka-protocol test
		// broker built where apache/kafka cannot be pulled.
		"IDEMQ_KFAKE_LISTEN":     ":" + p,
		"IDEMQ_KFAKE_ADVERTISE":  addr,
		"IDEMQ_KFAKE_PARTITIONS": "3",
	}))
	return s, addr, err
}

// containerPorts are the ports each service listens on inside its container.
// Kafka listens on the host port itself, so that the address it advertises
// is right on both sides of the mapping.
func (s *service) containerPort() network.Port {
	n := map[string]int{"postgres": 5432, "rabbitmq": 5672}[s.name]
	if n == 0 {
		n = s.hostPort
	}
	p, _ := network.ParsePort(strconv.Itoa(n) + "/tcp")
	return p
}

// run creates and starts the container with the service's port published
// on 127.0.0.1:hostPort, then waits until the service is ready.
func (s *service) run(opts ...testcontainers.ContainerCustomizer) error {
	ctx, cancel := context.WithTimeout(context.Background(), s.readyTimeout+time.Minute)
	defer cancel()
	cport := s.containerPort()
	opts = append([]testcontainers.ContainerCustomizer{
		testcontainers.WithExposedPorts(cport.String()),
		testcontainers.WithHostConfigModifier(func(hc *container.HostConfig) {
			// A fixed host port survives restarts, so clients
			// reconnect to the address they were given.
			hc.PortBindings = network.PortMap{cport: {{
				HostIP:   netip.MustParseAddr("127.0.0.1"),
				HostPort: strconv.Itoa(s.hostPort),
			}}}
		}),
		testcontainers.WithLabels(map[string]string{"org.idemq.test": s.name}),
	}, opts...)
	ctr, err := testcontainers.Run(ctx, s.image, opts...)
	if ctr != nil {
		s.ctr = ctr
	}
	if err != nil {
		if ctr != nil {
			_ = ctr.Terminate(context.Background())
			s.ctr = nil
		}
		return fmt.Errorf("start %s container from image %s: %w (is Docker running? Or set %s to use an existing server)", s.name, s.image, err, s.endpointVar)
	}
	if err := s.waitReady(ctx); err != nil {
		s.ctr = nil
		_ = ctr.Terminate(context.Background())
		return err
	}
	return nil
}

// waitReady polls the service until it is ready or readyTimeout passes.
func (s *service) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.readyTimeout)
	defer cancel()
	var last error
	for {
		attempt, cancelAttempt := context.WithTimeout(ctx, 5*time.Second)
		last = s.ready(attempt)
		cancelAttempt()
		if last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s (image %q) not ready after %s: %w%s", s.name, s.image, s.readyTimeout, last, s.logTail())
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// logTail returns the end of the container's log, for error messages.
func (s *service) logTail() string {
	if s.ctr == nil {
		return ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rc, err := s.ctr.Logs(ctx)
	if err != nil {
		return ""
	}
	defer rc.Close()
	var b strings.Builder
	buf := make([]byte, 32<<10)
	for {
		n, err := rc.Read(buf)
		b.Write(buf[:n])
		if err != nil {
			break
		}
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return "\ncontainer log (tail):\n" + strings.Join(lines, "\n")
}

// container returns the service's container, or fails t with a clear
// message if the service is an existing endpoint: fault tests need a
// container to stop, kill or pause.
func (s *service) container(t testing.TB) *testcontainers.DockerContainer {
	t.Helper()
	if s.ctr == nil {
		t.Fatalf("this fault test stops, kills or pauses the %s container, but %s is set, so the suite uses that server and started no container; unset %s, or leave the fault tests out with -skip Fault", s.name, s.endpointVar, s.endpointVar)
	}
	return s.ctr
}

// stop stops the container gracefully (its stop signal, then SIGKILL
// after timeout).
func (s *service) stop(t testing.TB, timeout time.Duration) {
	t.Helper()
	ctr := s.container(t)
	ctx, cancel := context.WithTimeout(context.Background(), timeout+time.Minute)
	defer cancel()
	if err := ctr.Stop(ctx, &timeout); err != nil {
		t.Fatalf("stop %s container: %v", s.name, err)
	}
}

// kill sends SIGKILL to the container: a crash.
func (s *service) kill(t testing.TB) {
	t.Helper()
	s.docker(t, "kill", func(ctx context.Context, c *testcontainers.DockerClient, id string) error {
		_, err := c.ContainerKill(ctx, id, client.ContainerKillOptions{Signal: "SIGKILL"})
		if err != nil {
			return err
		}
		// Wait until Docker sees it stopped, so Start starts it anew.
		for {
			st, err := s.ctr.State(ctx)
			if err != nil {
				return err
			}
			if !st.Running {
				return nil
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
		}
	})
}

// start starts the stopped container and waits until the service is ready.
func (s *service) start(t testing.TB) {
	t.Helper()
	ctr := s.container(t)
	ctx, cancel := context.WithTimeout(context.Background(), s.readyTimeout+time.Minute)
	defer cancel()
	if err := ctr.Start(ctx); err != nil {
		t.Fatalf("start %s container: %v", s.name, err)
	}
	if err := s.waitReady(ctx); err != nil {
		t.Fatalf("after restart: %v", err)
	}
}

// pause freezes the container's processes (docker pause): connections stay
// open but nothing answers, like a network stall.
func (s *service) pause(t testing.TB) {
	t.Helper()
	s.docker(t, "pause", func(ctx context.Context, c *testcontainers.DockerClient, id string) error {
		_, err := c.ContainerPause(ctx, id, client.ContainerPauseOptions{})
		return err
	})
}

// unpause resumes a paused container and waits until the service is ready.
func (s *service) unpause(t testing.TB) {
	t.Helper()
	s.container(t)
	ctx, cancel := context.WithTimeout(context.Background(), s.readyTimeout)
	defer cancel()
	if err := s.unpauseErr(ctx); err != nil {
		t.Fatalf("unpause %s container: %v", s.name, err)
	}
	if err := s.waitReady(ctx); err != nil {
		t.Fatalf("after unpause: %v", err)
	}
}

func (s *service) unpauseErr(ctx context.Context) error {
	if s.ctr == nil {
		return nil
	}
	st, err := s.ctr.State(ctx)
	if err != nil || !st.Paused {
		return err
	}
	c, err := testcontainers.NewDockerClientWithOpts(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	_, err = c.ContainerUnpause(ctx, s.ctr.GetContainerID(), client.ContainerUnpauseOptions{})
	return err
}

func (s *service) docker(t testing.TB, op string, f func(context.Context, *testcontainers.DockerClient, string) error) {
	t.Helper()
	ctr := s.container(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := testcontainers.NewDockerClientWithOpts(ctx)
	if err != nil {
		t.Fatalf("%s %s container: docker client: %v", op, s.name, err)
	}
	defer c.Close()
	if err := f(ctx, c, ctr.GetContainerID()); err != nil {
		t.Fatalf("%s %s container: %v", op, s.name, err)
	}
}

// pgReady connects and runs a query.
func pgReady(url string) func(context.Context) error {
	return func(ctx context.Context) error {
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return err
		}
		defer conn.Close(context.Background())
		var one int
		return conn.QueryRow(ctx, "SELECT 1").Scan(&one)
	}
}

// amqpReady opens a connection and a channel.
func amqpReady(url string) func(context.Context) error {
	return func(ctx context.Context) error {
		dl, _ := ctx.Deadline()
		conn, err := amqp.DialConfig(url, amqp.Config{
			Dial: func(network, addr string) (net.Conn, error) {
				return (&net.Dialer{Deadline: dl}).DialContext(ctx, network, addr)
			},
		})
		if err != nil {
			return err
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		return ch.Close()
	}
}

// kafkaReady asks the first broker for metadata and checks that it lists
// brokers and a controller.
func kafkaReady(brokers string) func(context.Context) error {
	addr := strings.Split(brokers, ",")[0]
	return func(ctx context.Context) error {
		transport := &kafkago.Transport{}
		defer transport.CloseIdleConnections()
		c := &kafkago.Client{Addr: kafkago.TCP(addr), Transport: transport}
		md, err := c.Metadata(ctx, &kafkago.MetadataRequest{})
		if err != nil {
			return err
		}
		if len(md.Brokers) == 0 {
			return errors.New("metadata lists no brokers")
		}
		return nil
	}
}

// freePort returns a TCP port that is free on 127.0.0.1 right now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
