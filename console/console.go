package console

import (
	"cmp"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/deadletter"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/sqldb"
)

// DefaultScanLimit is how many waiting dead letters a page of the console looks at, oldest
// first, when Config.ScanLimit is zero.
const DefaultScanLimit = 1000

// Config configures a Console. Every source is optional: the console shows what it was given
// and says what it was not.
type Config struct {
	// Router is the router of the service the console is mounted in: the handlers' state,
	// deliveries in flight, rates and counts come from it (Router.Status). Without it they come
	// from the tables in DB, which say less (docs/console.md).
	Router *onceflow.Router

	// DB is the application database: its dedup table, outbox and the record of the last purge
	// show as storage, and, without Router, the handlers.
	DB *sqldb.DB
	// DedupTable, DeliveriesTable and OutboxTable name the tables in DB. Default to
	// dedup.DefaultTable, dedup.DefaultCounterTable and outbox.DefaultTable.
	DedupTable, DeliveriesTable, OutboxTable string
	// OutboxGroup is the consumer group of the outbox relays whose backlog storage shows.
	// Defaults to outbox.DefaultConsumerGroup.
	OutboxGroup string

	// Broker holds the dead-letter topic; the dead letters shown are those waiting for its
	// consumer group (broker.Options.ConsumerGroup, or the URL's group=). Without it the
	// console shows no dead letters.
	Broker *broker.Broker
	// DeadLetterTopic is the dead-letter topic. Defaults to onceflow.DefaultDeadLetterTopic.
	DeadLetterTopic string
	// ScanLimit bounds how many waiting dead letters a list, a search or a replay of
	// everything that matches looks at, oldest first. Defaults to DefaultScanLimit.
	ScanLimit int

	// Authorize decides each request that changes something: replaying or deleting dead
	// letters. It returns nil to allow the request, or an error that says why not, which the
	// console shows. Without it the console is read-only: it refuses every change. Reads are
	// not passed to it: protect them by mounting the console behind the service's own
	// authentication.
	Authorize func(*http.Request) error

	// Logger receives a line for each change made through the console: what was asked, by
	// which remote address, and what was done. Defaults to slog.Default().
	Logger *slog.Logger

	// Title names the service in the page's header. Defaults to "onceflow".
	Title string
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	for _, t := range []struct{ field, name string }{{"DedupTable", c.DedupTable}, {"DeliveriesTable", c.DeliveriesTable}, {"OutboxTable", c.OutboxTable}} {
		if t.name != "" {
			if err := sqldb.CheckIdentifier("console: Config."+t.field, t.name); err != nil {
				return err
			}
		}
	}
	if c.ScanLimit < 0 {
		return fmt.Errorf("console: Config.ScanLimit: %d is negative (0 selects the default)", c.ScanLimit)
	}
	return nil
}

// Console is an operator's console over a onceflow service: an http.Handler that serves a
// page and the JSON API it uses (docs/console.md). Mount it under a path of its own, with the
// prefix stripped:
//
//	mux.Handle("/ops/onceflow/", http.StripPrefix("/ops/onceflow", c))
//
// It is read-only unless Config.Authorize is set. Requests that change something must be POSTs
// with a JSON body from the console's own origin: cross-origin requests
// (http.CrossOriginProtection) and form posts are refused, so another site cannot make an
// operator's browser replay or delete. Every text that comes from a message (ids, reasons,
// headers, payloads) reaches the page as JSON data that the page's script puts in as text,
// never as markup; the page allows no inline script (Content-Security-Policy). URLs are shown
// without their passwords (the String of broker.Broker and sqldb.DB).
type Console struct {
	cfg       Config
	mux       *http.ServeMux
	crossSite *http.CrossOriginProtection
	queue     *deadletter.Queue // nil without a broker
	handlers  handlerSource
	storage   *storageSource // nil without a database
	page      *template.Template
	logger    *slog.Logger
}

//go:embed assets
var assets embed.FS

// New returns the console cfg describes.
func New(cfg Config) (*Console, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.DeadLetterTopic = cmp.Or(cfg.DeadLetterTopic, onceflow.DefaultDeadLetterTopic)
	cfg.ScanLimit = cmp.Or(cfg.ScanLimit, DefaultScanLimit)
	cfg.DedupTable = cmp.Or(cfg.DedupTable, dedup.DefaultTable)
	cfg.DeliveriesTable = cmp.Or(cfg.DeliveriesTable, dedup.DefaultCounterTable)
	cfg.OutboxTable = cmp.Or(cfg.OutboxTable, outbox.DefaultTable)
	cfg.OutboxGroup = cmp.Or(cfg.OutboxGroup, outbox.DefaultConsumerGroup)
	cfg.Title = cmp.Or(cfg.Title, "onceflow")
	c := &Console{cfg: cfg, crossSite: http.NewCrossOriginProtection(), logger: cmp.Or(cfg.Logger, slog.Default())}
	if cfg.Broker != nil {
		q, err := deadletter.New(cfg.Broker, deadletter.Config{Topic: cfg.DeadLetterTopic, ScanLimit: cfg.ScanLimit})
		if err != nil {
			return nil, fmt.Errorf("console: %w", err)
		}
		c.queue = q
	}
	if cfg.DB != nil {
		s, err := newStorageSource(cfg)
		if err != nil {
			return nil, err
		}
		c.storage = s
	}
	switch {
	case cfg.Router != nil:
		c.handlers = newRouterSource(cfg.Router)
	case cfg.DB != nil:
		c.handlers = newDatabaseSource(cfg, c.queue)
	default:
		c.handlers = noHandlers{}
	}
	page, err := template.ParseFS(assets, "assets/index.html")
	if err != nil {
		return nil, fmt.Errorf("console: parse the page: %w", err)
	}
	c.page = page
	c.routes()
	return c, nil
}

func (c *Console) routes() {
	static, _ := fs.Sub(assets, "assets")
	files := http.FileServerFS(static)
	c.mux = http.NewServeMux()
	c.mux.HandleFunc("GET /{$}", c.index)
	c.mux.Handle("GET /assets/", http.StripPrefix("/assets", files))
	c.mux.HandleFunc("GET /api/info", c.apiInfo)
	c.mux.HandleFunc("GET /api/handlers", c.apiHandlers)
	c.mux.HandleFunc("GET /api/storage", c.apiStorage)
	c.mux.HandleFunc("GET /api/dead-letters", c.apiDeadLetters)
	c.mux.HandleFunc("GET /api/dead-letter", c.apiDeadLetter)
	c.mux.HandleFunc("POST /api/dead-letters/replay", c.change(c.apiReplay))
	c.mux.HandleFunc("POST /api/dead-letters/delete", c.change(c.apiDelete))
}

// ServeHTTP serves the page, its assets and the JSON API, with headers that keep the page
// from running any script but its own and from being framed by another site.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "no-referrer")
	if r.URL.Path == "" {
		// Mounted at /ops with the prefix stripped, and asked for /ops: the page's relative
		// links need the slash.
		path, _, _ := strings.Cut(r.RequestURI, "?")
		http.Redirect(w, r, path+"/", http.StatusMovedPermanently)
		return
	}
	c.mux.ServeHTTP(w, r)
}

// readOnlyReason says why the console refuses changes; empty when it allows them.
func (c *Console) readOnlyReason() string {
	if c.cfg.Authorize == nil {
		return "the console is read-only: the service mounts it without an authorisation hook (console.Config.Authorize), or onceflow console runs without --allow-changes"
	}
	return ""
}

// errRefused is the error of a change the console refuses.
var errRefused = errors.New("refused")

// change wraps the handler of a request that changes something: it must come from the
// console's own origin, with a JSON body, and be allowed by Config.Authorize.
func (c *Console) change(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := c.crossSite.Check(r); err != nil {
			writeError(w, http.StatusForbidden, fmt.Errorf("%w: %w", errRefused, err))
			return
		}
		if mt, _, _ := strings.Cut(r.Header.Get("Content-Type"), ";"); strings.TrimSpace(mt) != "application/json" {
			writeError(w, http.StatusUnsupportedMediaType, fmt.Errorf("%w: a change is a POST with a JSON body (Content-Type: application/json)", errRefused))
			return
		}
		if why := c.readOnlyReason(); why != "" {
			writeError(w, http.StatusForbidden, fmt.Errorf("%w: %s", errRefused, why))
			return
		}
		if err := c.cfg.Authorize(r); err != nil {
			writeError(w, http.StatusForbidden, fmt.Errorf("%w: not authorised: %w", errRefused, err))
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxBody)
		next(w, r)
	}
}

// maxBody bounds the JSON body of a change: a selection of ids.
const maxBody = 4 << 20

// index serves the page. The template holds no data from messages: the page's script reads
// everything from the JSON API.
func (c *Console) index(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	_ = c.page.Execute(w, struct{ Title string }{c.cfg.Title})
}

// now is the console's clock.
var now = time.Now
