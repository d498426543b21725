package onceflowtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"regexp"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/sqldb"
)

// The environment variables that choose the broker and the database of a run whose Config
// names none: the same test then runs on the embedded default on a laptop and against the real
// stack in CI.
const (
	EnvBroker = "ONCEFLOWTEST_BROKER"
	EnvDB     = "ONCEFLOWTEST_DB"
)

// Config configures a run: the handler under test, the messages it gets, how its effects are
// counted, and the faults. Handler, Message and Effects are required; every other field has a
// default sized for a test that takes seconds on the embedded default.
type Config struct {
	// Handler builds the handler under test, as the program builds it, from what env gives it:
	// its Subscriber and DB must be env's; Name, Topic (unless Config.Topic replaces it), QoS or
	// Chain, Processor or BatchProcessor and every other field are the handler's own. It runs in every consumer
	// process, and once in the run's own process to validate the handler and create its tables
	// (Router.Migrate). Required.
	Handler func(env Env) onceflow.Handler

	// Message returns the i-th message, i from 0 to Messages-1: what the handler's processor
	// gets. Required.
	Message func(i int) Message

	// Effects is a query on the handler's database that returns, for each message id, the
	// number of its effects: two columns, the id as the processor saw it
	// (messagedata.MessageData.ID) and a count, such as
	//
	//	SELECT payment_id, COUNT(*) FROM ledger GROUP BY payment_id
	//
	// Rows of ids the run did not publish (those of an earlier run) are ignored. An effect that
	// is applied twice must count twice: count rows of an append-only table, not a value that
	// an idempotent write would have set the same. Required.
	Effects string

	// Setup runs once, before any consumer starts, on the handler's database: it creates the
	// tables the processor writes (CREATE TABLE IF NOT EXISTS ...). The tables of onceflow
	// itself (duplicate detection, delivery counts, ordering) are created by the run.
	Setup func(ctx context.Context, db *sqldb.DB) error

	// Messages is the number of distinct messages. Defaults to 200.
	Messages int

	// BrokerURL is the broker to run on (broker.Open). Defaults to $ONCEFLOWTEST_BROKER, else
	// an SQLite queue in Dir. The test imports the broker's package (broker/amqp, ...), as the
	// program does; this package links the SQLite queue only.
	BrokerURL string
	// DBURL is the handler's database (sqldb.Open). Defaults to $ONCEFLOWTEST_DB, else an
	// SQLite database in Dir. The test imports the driver's package (sqldb/postgres, ...).
	DBURL string
	// Dir holds the embedded queue and database, and the consumers' logs. Defaults to the
	// test's temporary directory (Prove) or a new temporary directory, removed at the end (Run).
	Dir string

	// Topic is the topic the run publishes to and the handler consumes, in place of the
	// handler's Topic, in every process of the run: runs that share a broker at once (tests in
	// parallel, CI jobs) each take one of their own. Defaults to the handler's Topic.
	Topic string
	// DeadLetterTopic is where the consumers dead-letter messages, and where the run looks for
	// the poison messages. Defaults to the topic with "_dlq" appended.
	DeadLetterTopic string

	// Consumers is the number of competing consumer processes. Defaults to 2.
	Consumers int
	// Kills is the number of SIGKILLs at random moments, placed evenly over the run; each
	// killed consumer restarts armed to kill itself at the next crash point (CrashPoints, in
	// turn), so a run sees about twice as many deaths. Defaults to 4; None for none.
	Kills int
	// Cuts is the number of connection cuts, alternating between the broker and the database:
	// for each, every consumer connection through the run's loopback proxy is dropped and new
	// ones are refused for half a second. Only network services can be cut: on the embedded
	// default there are none. Defaults to 2; None for none.
	Cuts int
	// Duplicates is the number of messages published a second time with the same id, as a
	// producer that retries does. A handler that detects duplicates by position
	// (Dedup.ByOffset) or by the queue's acknowledgement (Dedup.AckInTransaction) takes a
	// second publish for a new message: it gets none. Defaults to Messages/10; None for none.
	Duplicates int
	// Failures is the number of messages whose processor fails once with a retryable error,
	// after it has written (in the transaction): the first time it returns nil for the message
	// in a consumer process. Defaults to Messages/50, at least 1; None for none.
	Failures int
	// Panics is the number of messages whose processor panics once, after it has written, as
	// Failures fail. Defaults to Messages/100, at least 1; None for none.
	Panics int
	// Poison are the messages that cannot succeed, published among the good ones: each must be
	// dead-lettered exactly once, and nothing of it applied. Defaults to DefaultPoison;
	// NoPoison publishes none. A handler whose chain has no dead-letter stage (BestEffort) gets
	// none.
	Poison []Poison

	// PublishOver spreads the publishing of the messages over about this long, so that the
	// faults fall among messages that still arrive, and the consumers restarted armed with a
	// crash point have messages to die on. Defaults to 2 s; None publishes them at once.
	PublishOver time.Duration

	// Keys is the number of ordering keys of the messages that Message leaves without one, for
	// a handler of ExactlyOnceInOrder: message i gets key i mod Keys and the next sequence of
	// that key. Defaults to 10.
	Keys int

	// Seed makes the choice of messages and faults repeatable (timing still varies). Defaults
	// to a random seed, which the report gives.
	Seed uint64
	// Settle is how long the effects and dead letters must stay unchanged, with every fault
	// done, before the run ends. Defaults to 2 s.
	Settle time.Duration
	// Stall ends the run when nothing changes for this long while messages are missing: they
	// are lost. Defaults to 30 s.
	Stall time.Duration

	// Name names the run in progress lines and logs. Defaults to the test's name (Prove) or
	// the handler's.
	Name string
	// Command runs one consumer process; the run passes it what it needs in its environment.
	// The program it runs must call Consume with the same Handler (Prove does it: the default,
	// under Prove, is the test binary itself, running the calling test). Run requires it.
	Command []string
	// Progress receives a progress line every few seconds; nil for none.
	Progress io.Writer
	// Logger receives the run's own logs. Defaults to discarding them.
	Logger *slog.Logger
}

// None, as Kills, Cuts, Duplicates, Failures or Panics, asks for no fault of that kind.
const None = -1

// Env is what a consumer process gives the handler it runs.
type Env struct {
	// Subscriber delivers the run's messages: the handler's Subscriber.
	Subscriber message.Subscriber
	// Publisher publishes to the run's broker, for a handler that publishes (an outbox relay).
	Publisher message.Publisher
	// DB is the handler's database, through the run's proxy when it is a network service.
	DB *sqldb.DB
	// Consumer is the number of the consumer process, from 0 to Consumers-1; -1 in the run's
	// own process.
	Consumer int
}

// Message is one message a run publishes.
type Message struct {
	// ID is the message id. Defaults to a fresh id per run and message, so that a run on a
	// database that holds an earlier run's effects counts its own.
	ID string
	// Payload is the message body.
	Payload []byte
	// Metadata are the message's headers.
	Metadata map[string]string
	// Key and Sequence are the ordering key and sequence (ordering.SetSequence). For a
	// handler of ExactlyOnceInOrder, a message without a Key gets one (see Config.Keys); with
	// a Key, Sequence must number the key's messages 1, 2, 3, ...
	Key      string
	Sequence uint64
}

// Poison is a message that cannot succeed. The built-in ones (PoisonPanic, PoisonError,
// PoisonLongID, PoisonCrashLoop) are a good message (the payload of message 0) that the run
// makes fail; one of the test's own is a Message that its handler refuses, such as a payload
// that does not decode:
//
//	onceflowtest.Poison{Name: "malformed", Message: onceflowtest.Message{Payload: []byte(`{"cents":`)}}
type Poison struct {
	// Name names it in the report: lowercase letters, digits and '-', at most 20 bytes.
	Name string
	// Message is the message, for one of the test's own. Its ID defaults to one made of the
	// run and the name.
	Message Message
	// fault is what the consumers do to a built-in one.
	fault fault
}

// The built-in poison messages.
var (
	// PoisonPanic: the processor panics on it every time, after it has written.
	PoisonPanic = Poison{Name: "panic", fault: faultPanicAlways}
	// PoisonError: the processor fails on it every time, after it has written, with an error
	// that running again might cure: it is retried and redelivered up to the handler's
	// delivery limit.
	PoisonError = Poison{Name: "error", fault: faultFailAlways}
	// PoisonLongID: its id is 300 bytes, more than a duplicate-detection record holds.
	// Published only to a handler that records ids, on a broker that carries such an id.
	PoisonLongID = Poison{Name: "long-id", fault: faultLongID}
	// PoisonCrashLoop: its processing kills the consumer process (SIGKILL) every time, before
	// the processor runs. Each death hands the message back after the broker's ack timeout, 5
	// s on the SQLite queue, so it is not in DefaultPoison.
	PoisonCrashLoop = Poison{Name: "crash-loop", fault: faultCrashAlways}
)

// DefaultPoison are the poison messages of a Config that names none.
var DefaultPoison = []Poison{PoisonPanic, PoisonError, PoisonLongID}

// NoPoison, as Config.Poison, publishes no poison message.
var NoPoison = []Poison{}

var poisonName = regexp.MustCompile(`^[a-z0-9-]{1,20}$`)

// CrashPoint is a moment in a message's processing at which a consumer kills itself with
// SIGKILL, to exercise one crash window of the guarantee model.
type CrashPoint string

// The crash points.
const (
	// AfterReceive: the message is in the router, nothing is written. A BestEffort handler has
	// acknowledged it already.
	AfterReceive CrashPoint = "after-receive"
	// BeforeCommit: the chain inside the handler's transaction has returned; the transaction
	// has not committed.
	BeforeCommit CrashPoint = "before-commit"
	// AfterCommit: the transaction committed (or the message was a duplicate, or
	// dead-lettered); the acknowledgement is not sent.
	AfterCommit CrashPoint = "after-commit"
	// DeadLetterPublish: the message's dead letter is published, not recorded, and the message
	// not acknowledged. Each first consumer process is armed with it, so that the first dead
	// letter it publishes kills it.
	DeadLetterPublish CrashPoint = "dead-letter"
)

// CrashPoints are the crash points that a consumer restarted after a random kill is armed
// with, in turn: after-commit first, the window that tells AtLeastOnce from ExactlyOnce, so
// that even a short run arms it.
var CrashPoints = []CrashPoint{AfterCommit, BeforeCommit, AfterReceive}

// validate reports the first invalid field of c.
func (c Config) validate() error {
	switch {
	case c.Handler == nil:
		return errors.New("onceflowtest: Config.Handler: nil (the function that builds the handler under test)")
	case c.Message == nil:
		return errors.New("onceflowtest: Config.Message: nil (the function that makes the i-th message)")
	case c.Effects == "":
		return errors.New("onceflowtest: Config.Effects: empty (the query that counts effects per message id)")
	case c.Messages < 0:
		return fmt.Errorf("onceflowtest: Config.Messages: %d is negative", c.Messages)
	case c.Consumers < 0, c.Keys < 0:
		return errors.New("onceflowtest: Config.Consumers and Config.Keys must not be negative")
	case c.Kills < None, c.Cuts < None, c.Duplicates < None, c.Failures < None, c.Panics < None:
		return errors.New("onceflowtest: Config.Kills, Cuts, Duplicates, Failures and Panics must not be negative (None asks for none)")
	case c.Settle < 0, c.Stall < 0, c.PublishOver < None:
		return errors.New("onceflowtest: Config.Settle, Config.Stall and Config.PublishOver must not be negative (None, as PublishOver, publishes at once)")
	}
	names := map[string]bool{}
	for _, p := range c.Poison {
		if !poisonName.MatchString(p.Name) {
			return fmt.Errorf("onceflowtest: Config.Poison: name %q is not 1 to 20 lowercase letters, digits or '-'", p.Name)
		}
		if names[p.Name] {
			return fmt.Errorf("onceflowtest: Config.Poison: %q is given twice", p.Name)
		}
		names[p.Name] = true
	}
	return nil
}

// withDefaults returns c with its defaults filled in, but for those that need the handler.
func (c Config) withDefaults() Config {
	if c.Messages == 0 {
		c.Messages = 200
	}
	if c.BrokerURL == "" {
		c.BrokerURL = os.Getenv(EnvBroker)
	}
	if c.DBURL == "" {
		c.DBURL = os.Getenv(EnvDB)
	}
	if c.Consumers == 0 {
		c.Consumers = 2
	}
	c.Kills = orDefault(c.Kills, 4)
	c.Cuts = orDefault(c.Cuts, 2)
	c.Duplicates = orDefault(c.Duplicates, c.Messages/10)
	c.Failures = orDefault(c.Failures, max(1, c.Messages/50))
	c.Panics = orDefault(c.Panics, max(1, c.Messages/100))
	c.Duplicates, c.Failures, c.Panics = min(c.Duplicates, c.Messages), min(c.Failures, c.Messages), min(c.Panics, c.Messages)
	if c.Poison == nil {
		c.Poison = DefaultPoison
	}
	if c.Keys == 0 {
		c.Keys = 10
	}
	if c.Seed == 0 {
		c.Seed = rand.Uint64()
	}
	switch c.PublishOver {
	case 0:
		c.PublishOver = 2 * time.Second
	case None:
		c.PublishOver = 0
	}
	if c.Settle == 0 {
		c.Settle = 2 * time.Second
	}
	if c.Stall == 0 {
		c.Stall = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// orDefault returns def for 0, 0 for None, and n otherwise.
func orDefault(n, def int) int {
	switch n {
	case 0:
		return def
	case None:
		return 0
	}
	return n
}
