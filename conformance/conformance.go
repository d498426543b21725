package conformance

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/onceflow/onceflow"

	_ "github.com/onceflow/onceflow/broker/all"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// Mode is how the handlers of a scenario commit: one transaction per message, group commit
// (Handler.GroupCommit), where concurrent deliveries share one transaction and each is acked
// after its commit, or the batch processor (Handler.BatchProcessor), which writes the new
// messages of a group with one statement in the group's transaction. Every scenario holds in
// all three.
type Mode string

// The commit modes.
const (
	// PerMessage runs the canonical ExactlyOnce chain: a transaction per message, with its
	// message id recorded in it. Handlers subscribe twice (Handler.Concurrency 2).
	PerMessage Mode = "per-message"
	// GroupCommit runs the ExactlyOnce chain with group commit: its transaction stage runs one
	// transaction per group, which records the group's message ids. Handlers subscribe four
	// times where the broker delivers concurrently, so that the deliveries it hands out at once
	// share a transaction, and twice where the consumers of a group take turns
	// (Features.ConcurrentDelivery).
	GroupCommit Mode = "group-commit"
	// Batch runs the ExactlyOnce chain with a Handler.BatchProcessor, which implies group
	// commit: the scenario's processor becomes a batch (one multi-row INSERT of the effects
	// where it writes nothing else, a message after the other otherwise, a failing one named
	// with processor.ErrorFor). Handlers subscribe as in GroupCommit.
	Batch Mode = "batch"
)

// Modes lists every commit mode.
var Modes = []Mode{PerMessage, GroupCommit, Batch}

// Setup says where the suite finds the broker and the database under test.
type Setup struct {
	// BrokerURL returns the URL of the broker under test for one test, in the form broker.Open
	// takes. Where the broker keeps its messages in a database or a file (postgres://,
	// mysql://, sqlite://), return a fresh one per call; a shared server is fine otherwise:
	// every test uses topics of its own, and removes the AMQP exchanges and queues, NATS
	// streams and Redis streams it created when it ends. Query parameters of the URL override
	// the suite's timings (see Timings). Required.
	BrokerURL func(t testing.TB) string

	// DatabaseURL returns the URL of a fresh, empty application database for one test, in
	// the form sqldb.Open takes (postgres://, mysql://, sqlite://). Required.
	DatabaseURL func(t testing.TB) string

	// Modes lists the commit modes every scenario runs in. Defaults to Modes (all three).
	Modes []Mode

	// Scenarios lists the scenarios to run, by name (ScenarioNames). Defaults to every
	// scenario.
	Scenarios []string

	// Timings are the broker's delays during the suite. Zero fields take the defaults of
	// DefaultTimings.
	Timings Timings

	// Chain, when set, edits the chain of every handler the suite runs, before the suite puts
	// in the stages of its own scenarios (outside retry, and just outside the transaction): the
	// way to run the scenarios with stages of one's own in the canonical ExactlyOnce chain. The
	// Poison scenario then runs its consumers as routers in the test process, which a function
	// can reach, and not as child processes.
	Chain func(onceflow.Chain) onceflow.Chain
}

// Timings are the broker options that decide how fast the suite runs (see broker.Options).
type Timings struct {
	// NackDelay is how long a nacked message waits before the broker delivers it again.
	// Defaults to 20 ms.
	NackDelay time.Duration
	// AckTimeout is how long a delivered message may stay unsettled before the broker delivers
	// it again (NATS, Redis, SQL and SQLite queues). It bounds how long the suite waits for
	// redeliveries after a connection cut. Defaults to 2 s.
	AckTimeout time.Duration
	// PollInterval is how often an idle SQL or SQLite consumer looks for messages. Defaults
	// to 10 ms.
	PollInterval time.Duration
}

// DefaultTimings are the timings of a Setup that sets none.
var DefaultTimings = Timings{NackDelay: 20 * time.Millisecond, AckTimeout: 2 * time.Second, PollInterval: 10 * time.Millisecond}

func (tm Timings) withDefaults() Timings {
	if tm.NackDelay == 0 {
		tm.NackDelay = DefaultTimings.NackDelay
	}
	if tm.AckTimeout == 0 {
		tm.AckTimeout = DefaultTimings.AckTimeout
	}
	if tm.PollInterval == 0 {
		tm.PollInterval = DefaultTimings.PollInterval
	}
	return tm
}

// Features says what the broker under test can do, so that the suite asks of it what it can
// give and skips what does not apply to it. DefaultFeatures knows onceflow's brokers.
type Features struct {
	// ConcurrentDelivery is true when the broker hands messages of one consumer group to
	// several consumers at once (RabbitMQ, NATS JetStream, Redis Streams). The suite then
	// requires that the two copies of a message in ConcurrentDuplicates are, at least once,
	// held by two consumers at the same time, and race into their transactions together.
	// Brokers whose consumers of a group take turns (the SQLite queue, mem) cannot have two
	// copies in flight at once, and the SQL queues seldom do: the first consumer to look
	// claims both copies of a burst (up to prefetch); the scenario still gives the two copies
	// to two consumers and requires one effect.
	ConcurrentDelivery bool

	// ProxyableConnection is true when the broker is a network service that the suite can
	// put a loopback TCP proxy in front of, to cut its connections mid-stream
	// (ConnectionCut). The embedded SQLite queue and mem have no connection to cut.
	ProxyableConnection bool

	// DeduplicatesPublishes is true when the broker drops a second publish of a message UUID
	// (NATS JetStream within its duplicate window, through Nats-Msg-Id). An outbox relay's
	// resend then never reaches the consumers; elsewhere it is delivered again and
	// duplicate detection absorbs it.
	DeduplicatesPublishes bool

	// DeduplicatesDeadLetters is true when the broker stores a dead letter published again
	// under its key (messagedata.HeaderDeadLetterKey) once: the SQLite and SQL queues within an hour,
	// NATS JetStream within its duplicate window. A consumer that dies between a dead letter's
	// publish and the router's record of it then leaves no second copy; elsewhere the next
	// consumer's publish is one.
	DeduplicatesDeadLetters bool

	// ForeignProducer publishes as a producer that is not watermill would, for
	// ForeignProducer. Nil leaves the scenario out.
	ForeignProducer ForeignProducer

	// ReturnsOnDisconnect is true when the broker gives the deliveries of a consumer whose
	// connection drops to the other consumers at once (RabbitMQ), rather than after AckTimeout.
	// A message that kills its consumer every time then goes from one consumer to the next
	// without a pause: the Poison scenario runs one consumer more than its delivery limit, so
	// that such a message cannot take them all down at once.
	ReturnsOnDisconnect bool

	// OneDeliveryAtATime is true when each subscription hands out one delivery at a time and
	// waits for its ack or nack before the next, and cannot delay a redelivery (a plain
	// watermill subscriber such as watermill-nats's; onceflow's own subscribers all keep many
	// deliveries in flight): the router then holds a failed message for its redelivery delay
	// before it nacks it, and the subscription's next deliveries wait behind it. The Poison
	// scenario reports the good messages' latency but does not bound it.
	OneDeliveryAtATime bool

	// PositionIDs is true when the broker gives a message that has no id the id of its
	// position, stable across redeliveries (Kafka: topic/partition/offset), so that it is
	// processed once rather than dead-lettered for want of an id. ForeignProducer then
	// requires the message without an id to have one effect.
	PositionIDs bool

	// Handover is how long, beyond the ack timeout, the broker takes to hand the messages of a
	// consumer that died to another one: Kafka's rebalance after the dead member's session
	// ends. The Poison scenario's redelivery horizon adds it for each death.
	Handover time.Duration

	// LongIDProducer publishes the Poison scenario's message whose id is longer than 255 bytes,
	// where the broker carries such an id but onceflow's publisher for it refuses one
	// (RabbitMQ: the message_id property holds 255 bytes, a header holds more). Nil publishes it
	// with the broker's own publisher; where that refuses it too (the SQL queues' uuid column
	// holds 36 bytes), the scenario leaves the message out and logs why.
	LongIDProducer ForeignProducer
}

// ForeignProducer publishes payload to topic on the broker at brokerURL the way a producer
// that does not use watermill does: with id as the broker's native message id (the AMQP
// message_id property, the NATS Nats-Msg-Id header, ...), or with no id at all when id is
// empty. It fails t when the broker does not take the message.
type ForeignProducer func(t testing.TB, brokerURL, topic, id string, payload []byte)

// DefaultFeatures returns the features of the onceflow broker that brokerURL names; only its
// scheme is read ("nats://" will do). An unknown scheme has none.
func DefaultFeatures(brokerURL string) Features {
	switch scheme(brokerURL) {
	case "amqp", "amqps":
		return Features{ConcurrentDelivery: true, ProxyableConnection: true, ForeignProducer: AMQPProducer,
			ReturnsOnDisconnect: true, LongIDProducer: AMQPUUIDProducer}
	case "nats":
		return Features{ConcurrentDelivery: true, ProxyableConnection: true, DeduplicatesPublishes: true, DeduplicatesDeadLetters: true,
			ForeignProducer: NATSProducer}
	case "redis", "rediss":
		return Features{ConcurrentDelivery: true, ProxyableConnection: true, ForeignProducer: RedisProducer}
	case "kafka":
		// Kafka clients reach the brokers at the addresses the cluster advertises, not
		// through a proxy in front of the seed broker: there is no connection to cut. The two
		// copies of one id share a key, and so a partition, and so a consumer.
		return Features{ForeignProducer: KafkaProducer, PositionIDs: true, Handover: time.Second}
	case "postgres", "postgresql", "mysql", "mariadb":
		return Features{ProxyableConnection: true, DeduplicatesDeadLetters: true}
	case "sqlite":
		return Features{DeduplicatesDeadLetters: true}
	}
	return Features{}
}

func scheme(rawURL string) string {
	s, _, _ := strings.Cut(rawURL, ":")
	return strings.ToLower(s)
}

// Scenario names, as they appear in test names.
const (
	ScenarioRedeliveryAfterCommit = "RedeliveryAfterCommit"
	ScenarioNackBeforeCommit      = "NackBeforeCommit"
	ScenarioConcurrentDuplicates  = "ConcurrentDuplicates"
	ScenarioOutbox                = "Outbox"
	ScenarioConnectionCut         = "ConnectionCut"
	ScenarioForeignProducer       = "ForeignProducer"
	ScenarioPoison                = "Poison"
	ScenarioOutage                = "Outage"
)

// ScenarioNames lists every scenario, in the order Run runs them.
var ScenarioNames = []string{
	ScenarioRedeliveryAfterCommit, ScenarioNackBeforeCommit, ScenarioConcurrentDuplicates, ScenarioOutbox,
	ScenarioConnectionCut, ScenarioForeignProducer, ScenarioPoison, ScenarioOutage,
}

type scenario struct {
	name string
	run  func(t *testing.T, f *fixture)
	// applies returns "" when the scenario applies to features, or why it does not.
	applies func(Features) string
}

var scenarios = []scenario{
	{name: ScenarioRedeliveryAfterCommit, run: testRedeliveryAfterCommit},
	{name: ScenarioNackBeforeCommit, run: testNackBeforeCommit},
	{name: ScenarioConcurrentDuplicates, run: testConcurrentDuplicates},
	{name: ScenarioOutbox, run: testOutbox},
	{name: ScenarioConnectionCut, run: testConnectionCut, applies: func(f Features) string {
		if !f.ProxyableConnection {
			return "the broker has no network connection to cut"
		}
		return ""
	}},
	{name: ScenarioForeignProducer, run: testForeignProducer, applies: func(f Features) string {
		if f.ForeignProducer == nil {
			return "no producer that is not watermill is known for the broker"
		}
		return ""
	}},
	{name: ScenarioPoison, run: testPoison},
	{name: ScenarioOutage, run: testOutage},
}

// Run runs every scenario that applies to features against the broker and database of s, in
// each mode of s.Modes, as parallel subtests named <mode>/<scenario>:
//
//   - RedeliveryAfterCommit: a message whose acknowledgement is lost after its commit is
//     delivered again and acked without a second effect; so is a copy that the producer
//     publishes again later.
//   - NackBeforeCommit: a message whose processing fails is rolled back, nacked, delivered
//     again by the broker, and applied once by the retry.
//   - ConcurrentDuplicates: two copies of a message given to two consumers (two routers, each
//     with its own broker connection), at the same time where the broker can, give one effect.
//   - Outbox: a handler that fails permanently after writing an outbox message sends nothing
//     (its message is dead-lettered with the reason); a handler that commits has each outgoing
//     message delivered at least once, through a relay whose publisher reports failures after
//     publishing, and applied once by the handler downstream.
//   - ConnectionCut: the consumers' broker connections are cut through a loopback TCP proxy
//     while a message is in flight, halfway through 50 messages, and restored: each of the 50
//     has exactly one effect.
//   - ForeignProducer: a message from a producer that is not watermill, carrying the broker's
//     native message id, is processed once; one without an id is dead-lettered with the reason.
//   - Poison: among 200 good messages, one message of each kind that cannot succeed (a data
//     error, a panic every time, an id longer than 255 bytes, a malformed payload; then, among
//     200 more, one that kills its consumer process every time) ends in the dead-letter topic
//     exactly once, within the delivery limit, with its reason; the good ones are applied
//     exactly once, with a p99 latency within twice that of the same messages without the
//     poison, measured side by side (reported, not bounded, for the crash loop). Its consumers
//     are child processes killed with SIGKILL when the test binary's TestMain calls
//     ConsumerMain (routers in this process, closed abruptly, otherwise).
//   - Outage: the handler's database is cut, through a loopback TCP proxy, in the middle of a
//     drain of 60 good messages with 3 among them that fail at every delivery, for three times
//     the whole redelivery schedule of a message: no good message is dead-lettered, lost or
//     applied twice, each failing one is dead-lettered once at the delivery limit, processing
//     resumes within 5 s of the database's return, and the handler takes few deliveries and
//     logs a handful of lines meanwhile (not on SQLite, a file without a connection).
//
// Each test has a database of its own (Setup.DatabaseURL), topics of its own, and asserts the
// exact number of effects per message in a table without a unique key, and the deliveries,
// acks and nacks the broker saw where they are determined.
func Run(t *testing.T, s Setup, features Features) {
	t.Helper()
	if s.BrokerURL == nil || s.DatabaseURL == nil {
		t.Fatal("conformance.Setup: BrokerURL and DatabaseURL are required")
	}
	modes := s.Modes
	if len(modes) == 0 {
		modes = Modes
	}
	var run []scenario
	for _, name := range s.Scenarios {
		if !slices.ContainsFunc(scenarios, func(sc scenario) bool { return sc.name == name }) {
			t.Fatalf("conformance.Setup.Scenarios: unknown scenario %q", name)
		}
	}
	for _, sc := range scenarios {
		if len(s.Scenarios) > 0 && !slices.Contains(s.Scenarios, sc.name) {
			continue
		}
		if sc.applies != nil {
			if why := sc.applies(features); why != "" {
				t.Logf("%s: not applicable: %s", sc.name, why)
				continue
			}
		}
		run = append(run, sc)
	}
	for _, m := range modes {
		t.Run(string(m), func(t *testing.T) {
			t.Parallel()
			for _, sc := range run {
				t.Run(sc.name, func(t *testing.T) {
					t.Parallel()
					sc.run(t, newFixture(t, s, features, m))
				})
			}
		})
	}
}
