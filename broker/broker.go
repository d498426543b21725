package broker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"
	"unicode"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/internal/inflight"
	"github.com/onceflow/onceflow/broker/internal/lifecycle"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/redact"
	"github.com/onceflow/onceflow/internal/urlparam"
	"github.com/onceflow/onceflow/internal/wmlog"
)

// Defaults of Options.
const (
	// DefaultConsumerGroup is the consumer group of a Broker whose Options name none.
	DefaultConsumerGroup = "onceflow"
	// DefaultPrefetch is how many messages an AMQP subscription or an SQL consumer takes ahead
	// of its acknowledgements when Options.Prefetch is zero.
	DefaultPrefetch = 10
	// DefaultNackDelay is how long a nacked message waits before it is delivered again when
	// Options.NackDelay is zero.
	DefaultNackDelay = time.Second
	// DefaultAckTimeout is how long a delivered message may stay unacknowledged before the
	// broker gives it to another consumer, when Options.AckTimeout is zero.
	DefaultAckTimeout = 30 * time.Second
	// DefaultPollInterval is how often an idle PostgreSQL or MySQL consumer looks for new
	// messages when Options.PollInterval is zero.
	DefaultPollInterval = 50 * time.Millisecond
	// DefaultConnectTimeout bounds each connect to the broker and the check that it answers,
	// when Options.ConnectTimeout is zero. It is sqldb.DefaultConnectTimeout.
	DefaultConnectTimeout = connect.DefaultTimeout
)

// NoNackDelay as Options.NackDelay asks for a nacked message to be delivered again at once
// (as at once as the broker allows). The URL form is nack_delay=0.
const NoNackDelay time.Duration = -1

// ErrClosed is returned by a closed Broker, and by the Publishers and Subscribers of a closed
// Broker.
var ErrClosed = errors.New("broker: closed")

// ErrNotFound is wrapped by the error of Peek, Move, Delete and Trim, on a Broker opened with
// Options.ReportNotFound, for a topic, or a consumer group of a topic, that does not exist on
// the broker; the error names which (NotFound).
//
// Every scheme but mem reports a topic that does not exist: no exchange (amqp), no tables
// (postgres, mysql, sqlite), no stream that captures its subject (nats), no stream (redis), no
// topic (kafka). Only amqp (no queue <topic>.<group>), postgres and mysql (no cursor row of
// the group) report a consumer group; on sqlite, nats, redis and kafka a group that does not
// exist reads like one that has not consumed the topic yet: every message of the topic waits
// for it. A topic that was created and then emptied exists, on every scheme.
var ErrNotFound = errors.New("does not exist")

// NotFound returns an error wrapping ErrNotFound that says which kind of thing, "topic" or
// "consumer group", of which name does not exist.
func NotFound(kind, name string) error {
	return fmt.Errorf("%s %q %w", kind, name, ErrNotFound)
}

// Options configure a Broker. The zero value is valid: every field has a default. The URL
// parameter a field names overrides it; docs/brokers.md says what each means for each scheme.
type Options struct {
	// ConsumerGroup names the consumer group of the Broker's Subscribers, whose consumers
	// compete, as the package documentation says. URL parameter: group. Defaults to "onceflow".
	ConsumerGroup string

	// Logger receives the logs of the underlying watermill adapters. Defaults to no logging.
	Logger *slog.Logger

	// Prefetch is how many deliveries each subscription holds unacknowledged at most: the
	// channel QoS on AMQP, the leases on SQL and SQLite, the window on NATS, Redis, Kafka and
	// mem. URL parameter: prefetch. Defaults to DefaultPrefetch for AMQP and SQL, and to the
	// scheme package's own elsewhere (nats.DefaultPrefetch, sqlitequeue.DefaultBatchSize,
	// redis.DefaultPrefetch, kafka.DefaultPrefetch, mem.DefaultPrefetch), raised to the window
	// a consumer asks for when it subscribes (redelivery.WithWindow: onceflow's router asks
	// for Handler.Concurrency). A prefetch set here or in the URL is kept as it is.
	Prefetch int

	// NackDelay is how long a nacked message waits before it is delivered again, so that a
	// message that keeps failing does not spin in a tight loop. NoNackDelay asks for no delay.
	// URL parameter: nack_delay (nack_delay=0 is NoNackDelay). Defaults to DefaultNackDelay.
	NackDelay time.Duration

	// AckTimeout is how long a delivered message may stay neither acked nor nacked before the
	// broker delivers it again, to another consumer when there is one, and its context is
	// cancelled: NATS AckWait, the Redis idle time before a claim, the lease of an SQL or
	// SQLite delivery, Kafka's session timeout and hand-out deadline. It bounds how long a dead
	// consumer's messages wait, and must exceed the longest processing time, retries included,
	// or a slow message is processed twice (deduplication absorbs that, at a cost). AMQP and
	// mem ignore it: RabbitMQ gives a consumer's messages back when its connection closes, mem
	// when its Subscriber closes. URL parameter: ack_timeout. Defaults to DefaultAckTimeout.
	AckTimeout time.Duration

	// PollInterval is how long an idle SQL or SQLite consumer waits before looking for new
	// messages again. URL parameter: poll_interval. Defaults to DefaultPollInterval for
	// PostgreSQL and MySQL and to sqlitequeue.DefaultPollInterval for SQLite.
	PollInterval time.Duration

	// ConnectTimeout bounds each connect to the broker, from the TCP dial to the end of the
	// TLS and protocol handshakes and the authentication (sqldb's connect_timeout for
	// PostgreSQL and MySQL), and the check Open makes that the broker answers (the JetStream
	// check, the Redis ping, the Kafka metadata request); also the connects of Subscribers and
	// reconnections. sqlite and mem have no connect and ignore it. URL parameter:
	// connect_timeout, a Go duration or whole seconds. Defaults to DefaultConnectTimeout.
	ConnectTimeout time.Duration

	// MustExist makes Open fail, with an error that errors.Is counts as fs.ErrNotExist,
	// instead of creating it, when the broker is a file that does not exist (sqlite://), so
	// that a command given a mistyped path reports it. Opening a server broker creates nothing.
	MustExist bool

	// ReportNotFound makes Peek, Move, Delete and Trim fail with an error wrapping ErrNotFound
	// on a topic, or a consumer group, that does not exist, where they otherwise find no
	// messages in it (a dead-letter topic exists from its first dead letter). Commands given
	// a name by an operator set it, so that a mistyped name is reported, not read as empty.
	ReportNotFound bool
}

// Validate reports the first invalid field. Zero values are valid: they select the defaults.
func (o Options) Validate() error {
	if len(o.ConsumerGroup) > 200 {
		return fmt.Errorf("broker: Options.ConsumerGroup: %d bytes is longer than 200", len(o.ConsumerGroup))
	}
	for _, r := range o.ConsumerGroup {
		if unicode.IsSpace(r) || !unicode.IsPrint(r) {
			return fmt.Errorf("broker: Options.ConsumerGroup: %q contains a space or control character", o.ConsumerGroup)
		}
	}
	return rules.Validate(inflight.Settings{Prefetch: o.Prefetch, NackDelay: o.NackDelay, AckTimeout: o.AckTimeout},
		inflight.Duration{Name: "PollInterval", Value: o.PollInterval},
		inflight.Duration{Name: "ConnectTimeout", Value: o.ConnectTimeout})
}

// rules read Options as the schemes' rules read their Configs: a negative value is refused,
// NoNackDelay excepted.
var rules = inflight.Rules{Scheme: "broker", Struct: "Options", AckTimeout: DefaultAckTimeout, NoNackDelay: true}

// withDefaults fills the fields that have the same default for every scheme.
func (o Options) withDefaults() Options {
	o.ConsumerGroup = cmp.Or(o.ConsumerGroup, DefaultConsumerGroup)
	o.Logger = cmp.Or(o.Logger, wmlog.Discard())
	o.NackDelay = cmp.Or(o.NackDelay, DefaultNackDelay)
	o.AckTimeout = cmp.Or(o.AckTimeout, DefaultAckTimeout)
	o.ConnectTimeout = cmp.Or(o.ConnectTimeout, DefaultConnectTimeout)
	return o
}

// Broker is a connection to one message broker, chosen by URL: it holds a shared Publisher and
// makes Subscribers. Open creates it. A Broker is safe for concurrent use.
type Broker struct {
	scheme   string
	redacted string
	secrets  []string
	opts     Options
	be       *Backend
	pub      *publisher
	// life holds the open Subscribers, and counts the Publish calls in progress.
	life lifecycle.Set[*subscriber]

	closeOnce sync.Once
	closeErr  error
}

// Open connects to the broker that rawURL names and returns a Broker over it. rawURL has one
// of the forms the package documentation lists, or an alias of its scheme (amqps, postgresql,
// mariadb, sqlite3, rediss; sqlite:///abs/path/queue.db names an absolute path), and the
// program imports the package that registers the scheme, or broker/all: the error of a scheme
// not registered names the import.
//
// The query parameters group, prefetch, nack_delay, ack_timeout, poll_interval and
// connect_timeout override the fields of opts. Each scheme takes a few more, which its package
// registers (Params) and docs/brokers.md lists; those of a database URL are sqldb.Open's. Open
// refuses any other parameter, and a value it cannot read, before it connects, naming it. It
// checks that the broker answers before it returns, within opts.ConnectTimeout for each
// connect. Errors and String never contain a password or token of the URL.
func Open(ctx context.Context, rawURL string, opts Options) (*Broker, error) {
	t, err := parseTarget(rawURL)
	if err != nil {
		return nil, err
	}
	opts, err = applyParams(opts, t.params, t.Redacted)
	if err != nil {
		return nil, err
	}
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	reg, err := lookup(t.Scheme)
	if err == nil {
		err = reg.table.Check(t.Parsed.Query())
	}
	if err != nil {
		return nil, fmt.Errorf("broker: URL %q: %w", t.Redacted, err)
	}
	be, err := reg.open(ctx, t.Target, opts)
	if err == nil && (be == nil || be.Publisher == nil || be.NewSubscriber == nil) {
		err = fmt.Errorf("the %s scheme opened no publisher or subscriber factory", t.Scheme)
	}
	if info, _ := schemeInfoOf(t.Scheme); err == nil && (be.View != nil) != info.inspect {
		err = fmt.Errorf("the %s scheme's view does not match what package broker says of it (inspect %v)", t.Scheme, info.inspect)
	}
	var unknown *urlparam.UnknownError
	if errors.As(err, &unknown) {
		// A parameter of a database URL that sqldb.Open refused: list Open's too.
		unknown = &urlparam.UnknownError{Param: unknown.Param, Table: unknown.Table.Under(commonParams), Cause: unknown.Cause}
		unknown.Table.Scheme = t.Scheme
		return nil, redact.Error(fmt.Errorf("broker: URL %q: %w", t.Redacted, unknown), t.secrets)
	}
	if err != nil {
		err = connect.Explain(ctx, opts.ConnectTimeout, err)
		return nil, redact.Error(fmt.Errorf("broker: open %s: %w", t.Redacted, err), t.secrets)
	}
	b := &Broker{
		scheme:   t.Scheme,
		redacted: t.Redacted,
		secrets:  t.secrets,
		opts:     opts,
		be:       be,
	}
	b.pub = &publisher{b: b}
	return b, nil
}

// Scheme returns the broker's kind: "amqp", "postgres", "mysql", "sqlite", "nats", "redis",
// "kafka" or "mem", whichever alias the URL used (amqps, postgresql, mariadb, rediss, ...).
func (b *Broker) Scheme() string { return b.scheme }

// String returns the broker's URL without its password or token.
func (b *Broker) String() string { return b.redacted }

// ConsumerGroup returns the consumer group of the Broker's Subscribers, after defaults and URL
// parameters.
func (b *Broker) ConsumerGroup() string { return b.opts.ConsumerGroup }

// MessagingSystem returns the broker's name as the OpenTelemetry messaging semantic conventions
// spell messaging.system: rabbitmq, postgresql, mysql, sqlite, nats, redis, kafka (mem for the
// in-process broker).
func (b *Broker) MessagingSystem() string {
	info, _ := schemeInfoOf(b.scheme)
	return info.system
}

// Publisher returns the Broker's publisher, shared and safe for concurrent use. A message is
// stored by the broker when Publish returns nil. Its Close does nothing, so that a watermill
// router that closes the publishers of its handlers does not close it: Broker.Close does.
// Publish on a closed Broker returns ErrClosed.
func (b *Broker) Publisher() message.Publisher { return b.pub }

// Subscriber returns a new consumer in the Broker's consumer group: each Subscribe call on it
// is one competing consumer of the topic. Closing the Subscriber ends its subscriptions;
// messages they held unacknowledged are delivered again. Close is idempotent and safe to call
// concurrently; it lets the adapter stop on its own for up to SubscriberCloseTimeout, then
// cancels its queries, so that a consumer waiting for another's lock does not hold Close up.
// Broker.Close closes the Subscribers that are still open.
func (b *Broker) Subscriber() (message.Subscriber, error) {
	if b.life.Closed() {
		return nil, ErrClosed
	}
	up, err := b.be.NewSubscriber()
	if err != nil {
		return nil, redact.Error(fmt.Errorf("broker: new subscriber of %s: %w", b.redacted, err), b.secrets)
	}
	s := &subscriber{b: b, up: up}
	if !b.life.Add(s) {
		_ = up.Close()
		return nil, ErrClosed
	}
	return s, nil
}

// checkTopic reports whether the scheme can carry topic.
func (b *Broker) checkTopic(topic string) error {
	if topic == "" {
		return errors.New("broker: topic is empty")
	}
	if b.be.CheckTopic != nil {
		return b.be.CheckTopic(topic)
	}
	return nil
}

// Close closes the Broker's open Subscribers, waits for Publish calls in progress, and closes
// the publisher and the connection. It is idempotent and safe to call concurrently.
func (b *Broker) Close() error {
	b.closeOnce.Do(func() {
		subs, _ := b.life.Close()
		var errs []error
		for _, s := range subs {
			errs = append(errs, s.Close())
		}
		b.life.Wait()
		errs = append(errs, b.be.Publisher.Close())
		if b.be.Close != nil {
			errs = append(errs, b.be.Close())
		}
		if err := errors.Join(errs...); err != nil {
			b.closeErr = redact.Error(fmt.Errorf("broker: close %s: %w", b.redacted, err), b.secrets)
		}
	})
	return b.closeErr
}
