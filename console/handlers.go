package console

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/deadletter"
	"github.com/onceflow/onceflow/dedup"
)

// This file holds where the handlers' status comes from: the router of the service the console
// is mounted in, or, for a console started beside the service, the tables of its database.

// handlersDoc is GET api/handlers.
type handlersDoc struct {
	// Source is "router" or "database": what the numbers are (Note says it in words).
	Source string    `json:"source"`
	At     time.Time `json:"at"`
	// RateWindowSeconds is the time each rate is measured over.
	RateWindowSeconds float64      `json:"rate_window_seconds"`
	Note              string       `json:"note"`
	Handlers          []handlerDoc `json:"handlers"`
}

// handlerDoc is one handler. A field the source cannot know is null.
type handlerDoc struct {
	Name  string    `json:"name"`
	Topic string    `json:"topic"`
	QoS   string    `json:"qos"`
	State *stateDoc `json:"state"`
	// InFlight is how many deliveries it is processing now (router).
	InFlight *int `json:"in_flight"`
	// Rate is deliveries ended per second (router), or messages applied per second (database),
	// over the last RateWindowSeconds.
	Rate *float64 `json:"rate"`
	// The deliveries by outcome since the router started (router); DeliveryLimit counts the
	// dead letters given up at the delivery limit, among DeadLettered.
	Processed     *int64 `json:"processed"`
	Duplicates    *int64 `json:"duplicates"`
	Failed        *int64 `json:"failed"`
	Panicked      *int64 `json:"panicked"`
	DeadLettered  *int64 `json:"dead_lettered"`
	DeliveryLimit *int64 `json:"delivery_limit"`
	// Applied is how many keys the handler has in the dedup table, and LastApplied when it
	// recorded the newest: when it last applied a message (database). Redelivered counts the
	// messages delivered more than once within the counter table's retention (database);
	// there DeadLettered counts the messages the counter table saw dead-lettered, and
	// DeliveryLimit the dead letters waiting that were given up at the delivery limit.
	Applied     *int64     `json:"applied"`
	LastApplied *time.Time `json:"last_applied"`
	Redelivered *int64     `json:"redelivered"`
}

type stateDoc struct {
	Kind   string    `json:"kind"`
	Reason string    `json:"reason,omitempty"`
	Since  time.Time `json:"since"`
}

// handlerSource gives the handlers' status.
type handlerSource interface {
	name() string
	status(ctx context.Context) (handlersDoc, error)
}

// rateWindow is the time a rate is measured over.
const rateWindow = time.Minute

// routerSource reads the router's status, and measures each handler's rate from the counts it
// saw when it was made and at its earlier calls (one sample a second at most, for rateWindow).
type routerSource struct {
	r *onceflow.Router

	mu      sync.Mutex
	samples map[string][]sample // by handler, oldest first
}

type sample struct {
	at    time.Time
	total int64
}

func newRouterSource(r *onceflow.Router) *routerSource {
	s := &routerSource{r: r, samples: map[string][]sample{}}
	at := now()
	for _, st := range r.Status() {
		s.samples[st.Name] = []sample{{at: at, total: st.Counts.Total()}}
	}
	return s
}

func (*routerSource) name() string { return "router" }

func (s *routerSource) status(context.Context) (handlersDoc, error) {
	at := now()
	doc := handlersDoc{Source: "router", At: at.UTC(), RateWindowSeconds: rateWindow.Seconds(), Handlers: []handlerDoc{},
		Note: "From the router of this process: deliveries by outcome since it started, deliveries ended per second."}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, st := range s.r.Status() {
		c := st.Counts
		d := handlerDoc{
			Name: st.Name, Topic: st.Topic, QoS: qosName(st.QoS),
			State:    &stateDoc{Kind: string(st.State.Kind), Reason: st.State.Reason, Since: st.State.Since.UTC()},
			InFlight: ptr(st.InFlight), Processed: ptr(c.Processed), Duplicates: ptr(c.Duplicates), Failed: ptr(c.Failed),
			Panicked: ptr(c.Panicked), DeadLettered: ptr(c.DeadLettered), DeliveryLimit: ptr(c.DeliveryLimit),
		}
		d.Rate = ptr(s.rate(st, at))
		doc.Handlers = append(doc.Handlers, d)
	}
	return doc, nil
}

// rate returns the deliveries per second of st's handler at at: over the samples of the last
// rateWindow, or, before there is one a second old, since the handler started running.
func (s *routerSource) rate(st onceflow.HandlerStatus, at time.Time) float64 {
	total := st.Counts.Total()
	ss := s.samples[st.Name]
	if len(ss) == 0 || at.Sub(ss[len(ss)-1].at) >= time.Second {
		ss = append(ss, sample{at: at, total: total})
	}
	for len(ss) > 2 && at.Sub(ss[1].at) >= rateWindow {
		ss = ss[1:] // keep one sample older than the window, so that the window is spanned
	}
	s.samples[st.Name] = ss
	if dt := at.Sub(ss[0].at); dt >= time.Second {
		return float64(total-ss[0].total) / dt.Seconds()
	}
	if up := at.Sub(st.State.Since); st.State.Kind == onceflow.StateRunning && up >= time.Second {
		return float64(total) / up.Seconds()
	}
	return 0
}

func qosName(q onceflow.QoS) string {
	if !q.Valid() {
		return "" // a chain named without a QoS
	}
	return q.String()
}

func ptr[T any](v T) *T { return &v }

// databaseSource reads the handlers from the tables of the application database: the handler
// claims and keys of the dedup table, and the delivery counter table. It reads each table
// whole, so it keeps what it read for cacheFor.
type databaseSource struct {
	store   *dedup.SQLStore
	counter *dedup.Counter
	queue   *deadletter.Queue // nil without a broker
	cache   cache[handlersDoc]
}

// cacheFor is how long the console keeps what it read from whole tables.
const cacheFor = 10 * time.Second

func newDatabaseSource(cfg Config, queue *deadletter.Queue) *databaseSource {
	// The configuration was validated: the tables' names are identifiers.
	store, _ := dedup.New(cfg.DB, dedup.Config{Table: cfg.DedupTable})
	counter, _ := dedup.NewCounter(cfg.DB, dedup.CounterConfig{Table: cfg.DeliveriesTable})
	return &databaseSource{store: store, counter: counter, queue: queue}
}

func (*databaseSource) name() string { return "database" }

func (s *databaseSource) status(ctx context.Context) (handlersDoc, error) {
	return s.cache.get(ctx, s.read)
}

func (s *databaseSource) read(ctx context.Context) (handlersDoc, error) {
	at := now()
	doc := handlersDoc{Source: "database", At: at.UTC(), RateWindowSeconds: rateWindow.Seconds(), Handlers: []handlerDoc{},
		Note: "From the tables of the database, read every " + cacheFor.String() + " at most: the handlers that recorded message ids, " +
			"the ids they recorded (applied messages still in " + s.store.Table() + "), messages applied per second, and the messages " +
			s.counter.Table() + " saw redelivered or dead-lettered; delivery-limit hits among the dead letters waiting. State, deliveries in flight and outcomes are known only to the service: mount the console there to see them."}
	claims, err := s.store.Handlers(ctx)
	if err != nil {
		return doc, err
	}
	keys := map[string]dedup.HandlerStats{}
	if len(claims) > 0 {
		if keys, err = s.store.HandlerKeys(ctx, at.Add(-rateWindow)); err != nil {
			return doc, err
		}
	}
	counts, err := s.counter.HandlerStats(ctx)
	if err != nil {
		return doc, err
	}
	atLimit, err := s.atLimit(ctx)
	if err != nil {
		return doc, err
	}
	topics := map[string]string{}
	var names []string
	for _, c := range claims {
		topics[c.Handler] = c.Topic
		names = append(names, c.Handler)
	}
	for h := range counts {
		if _, ok := topics[h]; !ok {
			names = append(names, h) // a handler without keys: AtLeastOnce with a delivery limit
		}
	}
	slices.Sort(names)
	for _, h := range names {
		d := handlerDoc{Name: h, Topic: topics[h]}
		if k, ok := keys[h]; ok {
			d.Applied, d.Rate = ptr(k.Keys), ptr(float64(k.Recent)/rateWindow.Seconds())
			d.LastApplied = ptr(k.Last.UTC())
		} else if _, claimed := topics[h]; claimed {
			d.Applied, d.Rate = ptr(int64(0)), ptr(0.0)
		}
		if c, ok := counts[h]; ok {
			d.Redelivered, d.DeadLettered = ptr(c.Redelivered), ptr(c.DeadLettered)
		}
		if atLimit != nil {
			d.DeliveryLimit = ptr(atLimit[h])
		}
		doc.Handlers = append(doc.Handlers, d)
	}
	return doc, nil
}

// atLimit counts, by handler, the dead letters waiting (among the first ScanLimit) that were
// given up at the delivery limit; nil without a broker.
func (s *databaseSource) atLimit(ctx context.Context) (map[string]int64, error) {
	if s.queue == nil {
		return nil, nil
	}
	page, err := s.queue.List(ctx, deadletter.Query{Limit: s.queue.ScanLimit(), Count: true})
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, l := range page.Letters {
		if l.DeliveryLimit() {
			out[l.Handler]++
		}
	}
	return out, nil
}

// noHandlers is the source of a console given neither a router nor a database.
type noHandlers struct{}

func (noHandlers) name() string { return "none" }

func (noHandlers) status(context.Context) (handlersDoc, error) {
	return handlersDoc{}, errors.New("no source of handlers: the console was given neither a router (console.Config.Router) nor a database (console.Config.DB, onceflow console --db)")
}

// cache keeps the result of an expensive read for cacheFor; one read runs at a time.
type cache[T any] struct {
	mu   sync.Mutex
	at   time.Time
	val  T
	err  error
	full bool
}

func (c *cache[T]) get(ctx context.Context, read func(context.Context) (T, error)) (T, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.full && now().Sub(c.at) < cacheFor {
		return c.val, c.err
	}
	c.val, c.err = read(ctx)
	c.at, c.full = now(), c.err == nil
	return c.val, c.err
}
