package broker

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// redisView reads a topic's stream with XPENDING and XRANGE: the group's pending entries (read
// by a consumer of the group, not acknowledged), then the entries past the group's
// last-delivered id; the whole stream before the group exists. It reads nothing with
// XREADGROUP, so no entry changes hands. remove acknowledges the entry for the group (XACK) and
// deletes it from the stream (XDEL).
type redisView struct {
	client   *redis.Client
	group    string
	topic    string
	exists   bool   // the stream exists
	hasGroup bool   // the group exists
	last     string // the group's last-delivered id
}

func newRedisView(client *redis.Client, group string) func(context.Context, string) (view, error) {
	return func(ctx context.Context, topic string) (view, error) {
		v := &redisView{client: client, group: group, topic: topic}
		n, err := client.Exists(ctx, topic).Result()
		if err != nil {
			return nil, fmt.Errorf("look up stream %q: %w", topic, err)
		}
		if n == 0 {
			return v, nil
		}
		v.exists = true
		groups, err := client.XInfoGroups(ctx, topic).Result()
		if err != nil {
			return nil, fmt.Errorf("look up the consumer groups of stream %q: %w", topic, err)
		}
		for _, g := range groups {
			if g.Name == group {
				v.hasGroup, v.last = true, g.LastDeliveredID
			}
		}
		return v, nil
	}
}

func (v *redisView) list(ctx context.Context, limit int) ([]entry, error) {
	if !v.exists {
		return nil, nil
	}
	if !v.hasGroup {
		msgs, err := v.client.XRangeN(ctx, v.topic, "-", "+", int64(limit)).Result()
		if err != nil {
			return nil, fmt.Errorf("read stream %q: %w", v.topic, err)
		}
		return redisEntries(msgs), nil
	}
	// Pending entries all come before the last-delivered id, new ones after it.
	pending, err := v.client.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: v.topic, Group: v.group, Start: "-", End: "+", Count: int64(limit),
	}).Result()
	if err != nil {
		return nil, fmt.Errorf("read the pending entries of group %q on stream %q: %w", v.group, v.topic, err)
	}
	var msgs []redis.XMessage
	for _, p := range pending {
		got, err := v.client.XRange(ctx, v.topic, p.ID, p.ID).Result()
		if err != nil {
			return nil, fmt.Errorf("read entry %s of stream %q: %w", p.ID, v.topic, err)
		}
		msgs = append(msgs, got...) // none for an entry deleted while pending
	}
	if len(msgs) < limit {
		newer, err := v.client.XRangeN(ctx, v.topic, "("+v.last, "+", int64(limit-len(msgs))).Result()
		if err != nil {
			return nil, fmt.Errorf("read stream %q: %w", v.topic, err)
		}
		msgs = append(msgs, newer...)
	}
	return redisEntries(msgs), nil
}

func redisEntries(msgs []redis.XMessage) []entry {
	out := make([]entry, len(msgs))
	for i, m := range msgs {
		msg, _ := redisMarshaller{}.Unmarshal(m.Values) // never fails
		out[i] = entry{msg: msg, pos: m.ID}
	}
	return out
}

func (v *redisView) remove(ctx context.Context, e entry) error {
	id := e.pos.(string)
	if v.hasGroup {
		if err := v.client.XAck(ctx, v.topic, v.group, id).Err(); err != nil {
			return fmt.Errorf("XACK entry %s of stream %q: %w", id, v.topic, err)
		}
	}
	if err := v.client.XDel(ctx, v.topic, id).Err(); err != nil {
		return fmt.Errorf("XDEL entry %s of stream %q: %w", id, v.topic, err)
	}
	return nil
}

func (v *redisView) close() error { return nil }
