package broker

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/urlparam"
)

// OpenFunc opens the backend of one scheme: the connection, the shared publisher and a way to
// make subscribers. Open calls it with the URL parsed and the options with the URL's parameters
// applied and the defaults every scheme shares set (NackDelay may be NoNackDelay); Prefetch
// and PollInterval are zero where the scheme's own default applies. It checks that the broker
// answers before it returns, within opts.ConnectTimeout for each connect and that check. ctx
// is Open's: it may end the wait, and the backend must not keep it.
type OpenFunc func(ctx context.Context, t Target, opts Options) (*Backend, error)

// Target is a broker URL, parsed, as an OpenFunc gets it.
type Target struct {
	// Scheme is the canonical scheme (amqp for amqps://, postgres for postgresql://, ...).
	Scheme string
	// URL is the URL without the query parameters that Open reads into Options: its query
	// parameters are those the scheme registered (Params).
	URL string
	// Parsed is URL parsed; for sqlite, whose URL names a file, it may hold the scheme alone.
	Parsed *url.URL
	// Redacted is the URL as given without its passwords and tokens, for messages.
	Redacted string
}

// Backend is what a scheme's OpenFunc provides; the Broker wraps it with what every scheme has
// in common (topic checks, redacted errors, idempotent Close, Peek, Move and Delete).
type Backend struct {
	// Publisher is the shared upstream publisher; Broker.Close closes it. A message is stored
	// when its Publish returns nil.
	Publisher message.Publisher

	// NewSubscriber makes an upstream subscriber: one consumer of the Broker's consumer group,
	// whose subscriptions keep the guarantees the package documentation lists. Its Close may
	// be called once: the Broker's subscriber makes it idempotent.
	NewSubscriber func() (message.Subscriber, error)

	// CheckTopic, if not nil, rejects a topic the scheme cannot carry, with an error that
	// names it. Nil accepts any non-empty topic.
	CheckTopic func(topic string) error

	// CheckMessage, if not nil, rejects a message the scheme cannot store, with an error that
	// says why.
	CheckMessage func(m *message.Message) error

	// PreparePublish, if not nil, runs before each Publish (declaring streams and the like).
	PreparePublish func(topic string) error

	// View, if not nil, opens a look at a topic's messages that wait for the consumer group,
	// for Peek, Move and Delete.
	View func(ctx context.Context, topic string) (View, error)

	// Trim, if not nil, is Broker.Trim for a scheme that keeps acknowledged messages (the SQL
	// and SQLite queues).
	Trim func(ctx context.Context, topic string) (int64, error)

	// Close, if not nil, releases what the publisher and the subscribers share, after both
	// are closed.
	Close func() error
}

// View is one look at the messages of a topic that wait for the consumer group.
type View interface {
	// List returns up to limit of the messages waiting for the group, oldest first, in the
	// order the group receives them. It is called once per view.
	List(ctx context.Context, limit int) ([]Entry, error)
	// Remove takes e, which List returned, out of the topic for the group, for good.
	Remove(ctx context.Context, e Entry) error
	// Close ends the view. Messages that List returned and Remove did not take stay waiting,
	// in their place.
	Close() error
}

// Claimer is a View that must take hold of the consumer group's share of the topic before it
// can Remove anything (Kafka's joins the group). Move and Delete call Claim once, before List,
// and publish or remove nothing when it fails; Peek does not call it.
type Claimer interface {
	Claim(ctx context.Context) error
}

// Entry is a message waiting for a consumer group, and where it is.
type Entry struct {
	Message *message.Message
	// Pos locates the message for Remove: an AMQP delivery tag, an SQL offset, a NATS stream
	// sequence, a Redis stream entry id.
	Pos any
	// PublishID, when not empty, is the Nats-Msg-Id (HeaderNATSMsgID) to publish the message
	// with when it is moved, so that JetStream does not drop it as a duplicate of its first
	// publish.
	PublishID string
}

// SubscriberCloseTimeout is how long the Close of a Broker's Subscriber lets the adapter stop
// on its own (hand back its messages, send the acknowledgements given so far) before it
// cancels the adapter's queries. Scheme packages give it to their adapters.
const SubscriberCloseTimeout = 2 * time.Second

// Params are the query parameters that a scheme takes beside those of every scheme, which Open
// reads into Options. Open refuses any other before it connects, with an error that names it
// and lists the known ones.
type Params struct {
	// Own are the scheme's own parameters, which its OpenFunc reads from Target.URL
	// (amqp's queue_type, kafka's partitions).
	Own []string
	// Client are the parameters that the scheme's client library documents, which Target.URL
	// passes on to it, and Client names that library ("amqp091-go").
	Client     []string
	ClientName string
	// Database says that Target.URL is a database URL, which the OpenFunc opens with
	// sqldb.Open, which checks its query parameters.
	Database bool
}

// registered is a scheme as its package registered it.
type registered struct {
	open   OpenFunc
	params Params
	table  urlparam.Table // params with those of every scheme
}

var registry struct {
	sync.RWMutex
	schemes map[string]registered // by canonical scheme
}

// Register makes Open open URLs of scheme, and of its aliases, with open, and accept the query
// parameters params names. scheme is one of the canonical schemes Open lists (amqp, postgres,
// mysql, sqlite, nats, redis, kafka, mem). Register is meant to be called from the init of the
// scheme's package; it panics when scheme is not one Open knows, when open is nil, or when the
// scheme already has an OpenFunc.
func Register(scheme string, open OpenFunc, params Params) {
	info, ok := schemeInfoOf(scheme)
	if !ok || open == nil {
		panic(fmt.Sprintf("broker: Register(%q): want a canonical scheme and an OpenFunc", scheme))
	}
	registry.Lock()
	defer registry.Unlock()
	if registry.schemes == nil {
		registry.schemes = map[string]registered{}
	}
	if _, dup := registry.schemes[scheme]; dup {
		panic(fmt.Sprintf("broker: Register called twice for scheme %q", scheme))
	}
	registry.schemes[scheme] = registered{open: open, params: params, table: params.table(info)}
}

// table returns the table of the query parameters of a URL of scheme info: those of every
// scheme, the scheme's own and its client's.
func (p Params) table(info schemeInfo) urlparam.Table {
	t := urlparam.Table{Scheme: info.name, Groups: []urlparam.Group{commonParams}}
	if len(p.Own) > 0 {
		t.Groups = append(t.Groups, urlparam.Group{Reader: strings.TrimPrefix(info.pkg, modulePath), Names: p.Own})
	}
	if len(p.Client) > 0 {
		t.Groups = append(t.Groups, urlparam.Group{Reader: p.ClientName, Names: p.Client})
	}
	if p.Database {
		t.Others = "the parameters of sqldb.Open's database URLs"
	}
	return t
}

// lookup returns the registration of a canonical scheme, or an error that names the package
// to import for it.
func lookup(scheme string) (registered, error) {
	registry.RLock()
	r, ok := registry.schemes[scheme]
	registry.RUnlock()
	if ok {
		return r, nil
	}
	info, _ := schemeInfoOf(scheme)
	return r, fmt.Errorf("scheme %s is not linked into this program: import _ %q (or %q for every scheme)", scheme, info.pkg, allPackage)
}
