package console

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/onceflow/onceflow/deadletter"
)

// This file is the JSON API under the page: each endpoint's document and handler.
// docs/console.md documents them for scripts.

// writeJSON writes v as the JSON response, with status.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	enc := json.NewEncoder(w) // escapes <, > and & in strings, so no JSON document is markup
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// errorDoc is the body of a failed request.
type errorDoc struct {
	Error string `json:"error"`
}

func writeError(w http.ResponseWriter, status int, err error) {
	writeJSON(w, status, errorDoc{Error: err.Error()})
}

// infoDoc is GET api/info: what the console looks at, and whether it allows changes.
type infoDoc struct {
	Title string `json:"title"`
	// Source is where the handlers' status comes from: "router", "database" or "none".
	Source          string `json:"source"`
	ReadOnly        bool   `json:"read_only"`
	ReadOnlyReason  string `json:"read_only_reason,omitempty"`
	Broker          string `json:"broker,omitempty"`
	ConsumerGroup   string `json:"consumer_group,omitempty"`
	DeadLetterTopic string `json:"dead_letter_topic,omitempty"`
	Database        string `json:"database,omitempty"`
	ScanLimit       int    `json:"scan_limit"`
}

func (c *Console) apiInfo(w http.ResponseWriter, _ *http.Request) {
	doc := infoDoc{Title: c.cfg.Title, Source: c.handlers.name(), ReadOnlyReason: c.readOnlyReason(), ScanLimit: c.cfg.ScanLimit}
	doc.ReadOnly = doc.ReadOnlyReason != ""
	if c.queue != nil {
		doc.Broker, doc.ConsumerGroup, doc.DeadLetterTopic = c.queue.Broker(), c.queue.Group(), c.queue.Topic()
	}
	if c.cfg.DB != nil {
		doc.Database = c.cfg.DB.String()
	}
	writeJSON(w, http.StatusOK, doc)
}

func (c *Console) apiHandlers(w http.ResponseWriter, r *http.Request) {
	doc, err := c.handlers.status(r.Context())
	if err != nil {
		writeError(w, http.StatusInternalServerError, err)
		return
	}
	writeJSON(w, http.StatusOK, doc)
}

func (c *Console) apiStorage(w http.ResponseWriter, r *http.Request) {
	if c.storage == nil {
		writeError(w, http.StatusNotFound, errors.New("no database: the console was given none (console.Config.DB, onceflow console --db)"))
		return
	}
	writeJSON(w, http.StatusOK, c.storage.status(r.Context()))
}

// letterDoc is a dead letter in a list: what its headers say, and the start of its payload.
type letterDoc struct {
	ID             string     `json:"id"`
	OriginalID     string     `json:"original_id,omitempty"`
	Topic          string     `json:"topic"`
	Handler        string     `json:"handler"`
	Reason         string     `json:"reason"`
	Time           *time.Time `json:"time"`
	Attempt        int        `json:"attempt"`
	Deliveries     int        `json:"deliveries"`
	Replays        int        `json:"replays"`
	DeliveryLimit  bool       `json:"delivery_limit"`
	PayloadSize    int        `json:"payload_size"`
	PayloadDropped string     `json:"payload_dropped,omitempty"`
	// PayloadPreview is the start of the payload: as text when it is UTF-8, else as hex.
	PayloadPreview string `json:"payload_preview,omitempty"`
}

// previewLength bounds PayloadPreview, in characters (or bytes, shown as hex).
const previewLength = 120

func letterSummary(l deadletter.Letter) letterDoc {
	d := letterDoc{
		ID: l.ID, OriginalID: l.OriginalID, Topic: l.Topic, Handler: l.Handler, Reason: l.Reason,
		Attempt: l.Attempt, Deliveries: l.Deliveries, Replays: l.Replays, DeliveryLimit: l.DeliveryLimit(),
		PayloadSize: l.PayloadSize, PayloadDropped: l.PayloadDropped,
	}
	if !l.Time.IsZero() {
		t := l.Time.UTC()
		d.Time = &t
	}
	switch p := l.Payload; {
	case utf8.Valid(p):
		if n := utf8.RuneCount(p); n > previewLength {
			d.PayloadPreview = string([]rune(string(p))[:previewLength]) + "…"
		} else {
			d.PayloadPreview = string(p)
		}
	default:
		d.PayloadPreview = fmt.Sprintf("% x", p[:min(len(p), previewLength/3)])
		if len(p) > previewLength/3 {
			d.PayloadPreview += " …"
		}
	}
	return d
}

// listDoc is GET api/dead-letters.
type listDoc struct {
	DeadLetters []letterDoc `json:"dead_letters"`
	Offset      int         `json:"offset"`
	Limit       int         `json:"limit"`
	// Matched counts the dead letters the filter matched among the Read waiting ones.
	Matched int  `json:"matched"`
	Read    int  `json:"read"`
	More    bool `json:"more"`
	// Truncated: ScanLimit dead letters were read; more may wait beyond them.
	Truncated bool `json:"truncated"`
	ScanLimit int  `json:"scan_limit"`
}

// defaultPage is how many dead letters a list shows when its request names no limit.
const defaultPage = 50

func (c *Console) apiDeadLetters(w http.ResponseWriter, r *http.Request) {
	if c.queue == nil {
		writeError(w, http.StatusNotFound, errNoBroker)
		return
	}
	q := r.URL.Query()
	filter, err := filterOf(q.Get("handler"), q.Get("topic"), q.Get("reason"), q.Get("since"), q.Get("until"))
	if err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	offset, err := intParam(q.Get("offset"), 0, "offset")
	if err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	limit, err := intParam(q.Get("limit"), defaultPage, "limit")
	if err != nil || limit <= 0 {
		writeError(w, http.StatusBadRequest, fmt.Errorf("limit %q: want a positive number", q.Get("limit")))
		return
	}
	page, err := c.queue.List(r.Context(), deadletter.Query{Filter: filter, Offset: offset, Limit: min(limit, c.cfg.ScanLimit), Count: true})
	if err != nil {
		writeError(w, http.StatusBadGateway, err)
		return
	}
	doc := listDoc{DeadLetters: []letterDoc{}, Offset: offset, Limit: limit, Matched: page.Matched, Read: page.Read,
		More: page.More, Truncated: page.Truncated, ScanLimit: c.cfg.ScanLimit}
	for _, l := range page.Letters {
		doc.DeadLetters = append(doc.DeadLetters, letterSummary(l))
	}
	writeJSON(w, http.StatusOK, doc)
}

var errNoBroker = errors.New("no broker: the console was given none (console.Config.Broker, onceflow console --broker)")

// fullLetterDoc is GET api/dead-letter?id=: one dead letter in full.
type fullLetterDoc struct {
	letterDoc
	Key     string            `json:"key,omitempty"`
	Headers map[string]string `json:"headers"`
	// PayloadFormat is "json" when the payload is a JSON document, "text" when it is other
	// UTF-8 text, "binary" otherwise.
	PayloadFormat string `json:"payload_format"`
	// PayloadText is the payload as text, when it is UTF-8.
	PayloadText *string `json:"payload_text,omitempty"`
	// PayloadBase64 is the payload, whatever it holds.
	PayloadBase64 string `json:"payload_base64"`
}

func (c *Console) apiDeadLetter(w http.ResponseWriter, r *http.Request) {
	if c.queue == nil {
		writeError(w, http.StatusNotFound, errNoBroker)
		return
	}
	id := r.URL.Query().Get("id")
	if id == "" {
		writeError(w, http.StatusBadRequest, errors.New("id is empty: api/dead-letter?id=ID"))
		return
	}
	l, err := c.queue.Get(r.Context(), id)
	switch {
	case errors.Is(err, deadletter.ErrNoLetter):
		writeError(w, http.StatusNotFound, err)
		return
	case err != nil:
		writeError(w, http.StatusBadGateway, err)
		return
	}
	doc := fullLetterDoc{letterDoc: letterSummary(l), Key: l.Key, Headers: l.Headers, PayloadBase64: base64.StdEncoding.EncodeToString(l.Payload)}
	doc.PayloadPreview = ""
	switch {
	case json.Valid(l.Payload):
		doc.PayloadFormat = "json"
	case utf8.Valid(l.Payload):
		doc.PayloadFormat = "text"
	default:
		doc.PayloadFormat = "binary"
	}
	if utf8.Valid(l.Payload) {
		text := string(l.Payload)
		doc.PayloadText = &text
	}
	writeJSON(w, http.StatusOK, doc)
}

// selectionDoc is the body of a replay or delete: which dead letters.
type selectionDoc struct {
	// IDs chooses the dead letters with these ids; with Exact, each id chooses one (the
	// confirmation step sends the ids the operator saw, so that one that arrived since is
	// left alone).
	IDs   []string `json:"ids"`
	Exact bool     `json:"exact"`
	// All chooses every dead letter the filter matches, instead of IDs.
	All    bool      `json:"all"`
	Filter filterDoc `json:"filter"`
	// To, for a replay, is the topic to publish to instead of each one's own.
	To string `json:"to"`
}

type filterDoc struct {
	Handler string `json:"handler"`
	Topic   string `json:"topic"`
	Reason  string `json:"reason"`
	Since   string `json:"since"`
	Until   string `json:"until"`
}

// resultDoc is one chosen dead letter in the report of a replay or delete.
type resultDoc struct {
	ID      string `json:"id"`
	Handler string `json:"handler"`
	Topic   string `json:"topic"`
	Reason  string `json:"reason"`
	// To is the topic a replay published it to, or would have.
	To    string `json:"to,omitempty"`
	Error string `json:"error,omitempty"`
}

// reportDoc is the response of a replay or delete: each chosen dead letter's fate.
type reportDoc struct {
	Done     []resultDoc `json:"done"`
	Failed   []resultDoc `json:"failed"`
	Kept     int         `json:"kept"`
	NotFound []string    `json:"not_found"`
	// Truncated: ScanLimit dead letters were looked at; more may wait beyond them.
	Truncated bool `json:"truncated"`
	// Error, when set, says why not every chosen dead letter was done.
	Error string `json:"error,omitempty"`
}

func (c *Console) apiReplay(w http.ResponseWriter, r *http.Request) {
	c.act(w, r, "replayed", func(sel deadletter.Selection, doc selectionDoc) (deadletter.Report, error) {
		return c.queue.Replay(r.Context(), sel, deadletter.ReplayOptions{To: doc.To})
	})
}

func (c *Console) apiDelete(w http.ResponseWriter, r *http.Request) {
	c.act(w, r, "deleted", func(sel deadletter.Selection, doc selectionDoc) (deadletter.Report, error) {
		if doc.To != "" {
			return deadletter.Report{}, fmt.Errorf("%w: to is for a replay", errBadSelection)
		}
		return c.queue.Delete(r.Context(), sel)
	})
}

var errBadSelection = errors.New("bad selection")

// act runs a replay or delete (done says which: replayed, deleted) of the selection in r's body and writes its report: 200
// when it went through, whatever became of each dead letter (the report says), an error
// status with the report so far when it could not.
func (c *Console) act(w http.ResponseWriter, r *http.Request, done string, do func(deadletter.Selection, selectionDoc) (deadletter.Report, error)) {
	if c.queue == nil {
		writeError(w, http.StatusNotFound, errNoBroker)
		return
	}
	var doc selectionDoc
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		writeError(w, http.StatusBadRequest, fmt.Errorf("read the selection: %w", err))
		return
	}
	f := doc.Filter
	filter, err := filterOf(f.Handler, f.Topic, f.Reason, f.Since, f.Until)
	if err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	sel := deadletter.Selection{IDs: doc.IDs, Exact: doc.Exact, All: doc.All, Filter: filter}
	if err := sel.Validate(); err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	rep, err := do(sel, doc)
	if errors.Is(err, errBadSelection) {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	out := reportDoc{Done: results(rep.Done), Failed: results(rep.Failed), Kept: len(rep.Kept), NotFound: rep.NotFound, Truncated: rep.Truncated}
	if out.NotFound == nil {
		out.NotFound = []string{}
	}
	status := http.StatusOK
	if err != nil {
		out.Error = err.Error()
		if len(rep.Failed) == 0 { // it stopped: the topic could not be read, or the request ended
			status = http.StatusBadGateway
		}
	}
	attrs := []any{"remote", r.RemoteAddr, "topic", c.queue.Topic(), "group", c.queue.Group(), "ids", len(doc.IDs), "all", doc.All}
	for _, kv := range [][2]string{{"handler", f.Handler}, {"from_topic", f.Topic}, {"reason", f.Reason}, {"since", f.Since}, {"until", f.Until}, {"to", doc.To}} {
		if kv[1] != "" {
			attrs = append(attrs, kv[0], kv[1])
		}
	}
	attrs = append(attrs, "done", len(out.Done), "failed", len(out.Failed), "not_found", len(out.NotFound))
	if out.Error != "" {
		attrs = append(attrs, "error", out.Error)
	}
	c.logger.Info("console: dead letters "+done, attrs...)
	writeJSON(w, status, out)
}

func results(rs []deadletter.Result) []resultDoc {
	out := []resultDoc{}
	for _, r := range rs {
		d := resultDoc{ID: r.Letter.ID, Handler: r.Letter.Handler, Topic: r.Letter.Topic, Reason: r.Letter.Reason, To: r.To}
		if r.Err != nil {
			d.Error = r.Err.Error()
		}
		out = append(out, d)
	}
	return out
}

// filterOf reads a filter: the times as RFC 3339.
func filterOf(handler, topic, reason, since, until string) (deadletter.Filter, error) {
	f := deadletter.Filter{Handler: handler, Topic: topic, Reason: reason}
	for _, t := range []struct {
		name, value string
		into        *time.Time
	}{{"since", since, &f.Since}, {"until", until, &f.Until}} {
		if t.value == "" {
			continue
		}
		v, err := time.Parse(time.RFC3339Nano, t.value)
		if err != nil {
			return f, fmt.Errorf("%s %q: want an RFC 3339 time, such as 2026-12-06T09:30:00Z", t.name, t.value)
		}
		*t.into = v
	}
	return f, nil
}

// intParam reads a query parameter that is a number of 0 or more, def when empty.
func intParam(s string, def int, name string) (int, error) {
	if s == "" {
		return def, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s %q: want a number of 0 or more", name, s)
	}
	return n, nil
}
